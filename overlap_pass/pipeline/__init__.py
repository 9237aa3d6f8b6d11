"""The pass itself: its stages in order (stages.py), the custom passes Inductor calls
(passes.py) and installing them (install.py), decision logging and strict reporting
(report.py), debug dumps (dumps.py), and the direct calls Inductor's generated code makes
(direct_calls.py)."""
