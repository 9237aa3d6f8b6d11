"""When a call may skip its barrier's wait (lowering/symm.EntryProofs): only after a call of
another kind waited on every peer since this kind's last call, on the same stream, and never
once someone else's CUDA graph capture has run a call of the group."""

from overlap_pass.lowering.symm import EntryProofs

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
MAIN, OTHER = "main stream", "other stream"


def _call(proofs, kind, stream=MAIN, waited=True) -> bool:
    """One call as the workspace makes it: decide, start, and (if it waited) prove."""
    skip = proofs.may_skip(kind, stream)
    proofs.called(kind)
    if waited:
        proofs.waited_on_every_peer(kind, stream)
    return skip


def test_a_block_skips_every_barrier_after_the_first_of_each_kind():
    proofs = EntryProofs()
    steps = [[_call(proofs, kind) for kind in (AG, RS, AG, RS)] for _ in range(3)]
    assert steps[0] == [False, False, True, True]  # nothing known of RS before its first call
    assert steps[1] == steps[2] == [True] * 4


def test_a_kind_never_proves_its_own_next_call():
    proofs = EntryProofs()
    _call(proofs, RS)
    assert [_call(proofs, AG) for _ in range(3)] == [False, False, False]


def test_the_proof_holds_on_its_stream_only():
    proofs = EntryProofs()
    _call(proofs, AG)
    _call(proofs, RS)
    assert not _call(proofs, AG, stream=OTHER)
    _call(proofs, RS, stream=OTHER)
    assert not _call(proofs, AG)  # proven on OTHER, called on MAIN


def test_a_call_that_did_not_wait_proves_nothing():
    proofs = EntryProofs()
    _call(proofs, AG)
    _call(proofs, RS, waited=False)
    assert not _call(proofs, AG)


def test_a_proof_is_used_once():
    proofs = EntryProofs()
    _call(proofs, AG)
    _call(proofs, RS)
    assert _call(proofs, AG, waited=False)
    assert not _call(proofs, AG)


def test_off_after_someone_elses_capture():
    proofs = EntryProofs()
    _call(proofs, AG)
    _call(proofs, RS)
    proofs.off = True  # Workspace.open_call, inside a capture it did not make
    assert [_call(proofs, kind) for kind in (AG, RS, AG, RS)] == [False] * 4
