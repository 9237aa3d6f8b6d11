"""The product speaks of the product: no tracked file, and no tracked file's name, tells how it
was built (numbered sessions, rounds or tasks of work, tracker issue numbers, which machines
could be had, how much machine time was left, end-of-round notes). Measurements say what they ran on instead: "measured on
2×H200 on 2026-11-24", "not yet measured at W=8". Upstream references such as
pytorch/pytorch#115388 are fine.

    python3 -m tests.cpu.test_no_history_words      # prints file:line: phrase for every hit
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
# (pattern, what it stands for): searched in every line of every tracked text file
DENY = [
    (r"\bsessions?[ -]\d+", "a numbered session of work"),
    (rf"\b(?:{_ORDINALS}|this|next|last|previous|earlier|later|that) session\b", "a session of work"),
    (r"\b[Rr]ounds? (?:[A-Z]\b|bench\w*)|\b[Rr]ound \d+\b", "a named round of work"),
    (r"\bissues? #?\d+", "a tracker issue number"),
    (r"\btasks? #?\d+", "a task number"),
    (r"\bdevice\s+time\b", "machine time accounting"),
    (r"\bbudget", "a time allowance"),
    (r"\b(?:not|was|were|is|are|been|being) lent\b", "machine availability"),
    (r"\bnvidia-h[12]00", "a machine kind of the lending"),
    (r"\bclosing\s+note", "an end-of-round note"),
    (r"\bwith(?:held)\b", "an end-of-round note"),
    (r"PERF_(?:REFERENCE)", "a reference document outside the product"),
    (r"\d{4}-\d{2}-\d{2}-s\d{1,2}\b", "a dated folder of a session"),
]
# (pattern, what it stands for): searched in every tracked path
DENY_IN_NAMES = [
    (r"(?:^|[/_.-])s\d{1,2}(?:$|[/_.-])", "a session number in a file name"),
    (r"closing[_-]?note", "an end-of-round note"),
]
# removed from a line before the search: upstream references (owner/repo#number)
ALLOW = re.compile(r"[\w.-]+/[\w.-]+#\d+")

_DENY = [(re.compile(p, re.IGNORECASE if p.islower() else 0), why) for p, why in DENY]
_DENY_IN_NAMES = [(re.compile(p), why) for p, why in DENY_IN_NAMES]


def hits_in_text(name: str, text: str) -> list[str]:
    """'name:line: phrase (what it stands for)' for every deny-listed phrase of ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        line = ALLOW.sub("", line)
        for pattern, why in _DENY:
            for match in pattern.finditer(line):
                found.append(f"{name}:{number}: {match.group(0)!r} ({why})")
    return found


def hits_in_name(path: str) -> list[str]:
    return [f"{path}: file name ({why})" for pattern, why in _DENY_IN_NAMES if pattern.search(path)]


def tracked_files(root: str = ROOT) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def hits(root: str = ROOT, paths=None) -> list[str]:
    """Every hit in the tracked files' names and in their text (binary files skipped)."""
    found = []
    for path in tracked_files(root) if paths is None else paths:
        found += hits_in_name(path)
        full = os.path.join(root, path)
        if not os.path.isfile(full):  # deleted in the work tree, not yet in git
            continue
        with open(full, "rb") as f:
            data = f.read()
        if b"\0" in data[:8192]:
            continue
        found += hits_in_text(path, data.decode("utf-8", errors="replace"))
    return found


def test_the_checker_finds_planted_phrases(tmp_path):
    planted = tmp_path / "notes.md"
    # the phrases are put together here, so that this file passes its own check
    session, lent, round_, issue, allowance = "sess" + "ion 18", "was " + "lent", "round " + "B", "issue " + "22", "bud" + "get"
    planted.write_text(
        "fine: 5 rounds of 20 calls, a session-scoped fixture, pytorch/pytorch#115388\n"
        f"Measured in {session} on the machine that {lent}.\n"
        f"Ready for {round_} ({issue}), if the {allowance} allows.\n"
    )
    dated_folder = "docs/bench/2026-11-25-" + "s18/log.txt"
    found = hits(str(tmp_path), ["notes.md", dated_folder])
    for line, phrase in ((2, session), (2, lent), (3, round_), (3, issue), (3, allowance)):
        assert any(h.startswith(f"notes.md:{line}: {phrase!r}") for h in found), (phrase, found)
    assert not any(h.startswith("notes.md:1:") for h in found), found
    assert any(h.startswith(f"{dated_folder}: file name") for h in found), found


def test_no_tracked_file_speaks_of_how_the_project_was_built():
    found = hits()
    assert not found, "history words in the tree:\n" + "\n".join(found)


if __name__ == "__main__":
    found = hits()
    print("\n".join(found) or "no hits")
    sys.exit(1 if found else 0)
