"""lowering/symm.outside_graph_pool without GPUs (CUDA calls stubbed): while CUDA graph trees
warm a model up (they route the calling thread's allocations to their pool), one-time setup runs
on a thread of its own; its result and its errors come back to the caller, and setup nested in
setup runs in place. Otherwise it runs in place, so that what it frees serves the model."""

import contextlib
import threading

import pytest
import torch

from overlap_pass.lowering import symm


class _Stream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def stubbed_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(symm, "new_stream", lambda device: _Stream())
    monkeypatch.setattr(symm, "_SETUP_STREAMS", {})
    monkeypatch.setattr(symm.torch_compat, "graph_trees_warming_up", lambda index: True)


def test_setup_runs_on_a_thread_of_its_own(stubbed_cuda):
    cuda = torch.device("cuda", 0)

    def setup(x):
        # nested setup (a rendezvous inside a measurement) stays on the setup thread
        inner = symm.outside_graph_pool(cuda, threading.current_thread)
        return x + 1, threading.current_thread(), inner

    value, thread, inner = symm.outside_graph_pool(cuda, setup, 41)
    assert value == 42
    assert thread is not threading.current_thread() and thread.name == "overlap-setup"
    assert inner is thread


def test_a_setup_error_reaches_the_caller(stubbed_cuda):
    def setup():
        raise ValueError("rendezvous failed")

    with pytest.raises(ValueError, match="rendezvous failed"):
        symm.outside_graph_pool(torch.device("cuda", 0), setup)


def test_without_cuda_setup_runs_in_place():
    assert symm.outside_graph_pool(torch.device("cpu"), threading.current_thread) is threading.current_thread()
    assert symm.outside_graph_pool(None, lambda: 7) == 7


def test_outside_a_graph_trees_warm_up_setup_runs_in_place(stubbed_cuda, monkeypatch):
    monkeypatch.setattr(symm.torch_compat, "graph_trees_warming_up", lambda index: False)
    assert symm.outside_graph_pool(torch.device("cuda", 0), threading.current_thread) is threading.current_thread()


def test_graph_trees_that_cannot_be_asked_count_as_warming_up(stubbed_cuda, monkeypatch):
    def moved(index):
        raise AttributeError("cudagraph_trees.get_manager moved")

    monkeypatch.setattr(symm.torch_compat, "graph_trees_warming_up", moved)
    thread = symm.outside_graph_pool(torch.device("cuda", 0), threading.current_thread)
    assert thread is not threading.current_thread() and thread.name == "overlap-setup"


def test_setup_sees_the_knobs_its_caller_set(stubbed_cuda):
    """From torch 2.13 on, what code sets in a config module lives in a context variable: the
    setup thread runs in a copy of the caller's context, so a measurement there reads the
    knobs as the caller set them (the choice cache, the spin limit, a forced variant)."""
    from overlap_pass import config

    def knobs():
        return config.spin_limit, config.hot().spin_limit

    with config.patch(spin_limit=1234):
        assert symm.outside_graph_pool(torch.device("cuda", 0), knobs) == (1234, 1234)
