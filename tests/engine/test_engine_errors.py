"""Bad input: a clear error on every rank, before any K/V collective, never a hang."""

import pytest
import torch

from megatron_ext.testing import catch as _catch, pool_fixture


pool = pool_fixture(2)


def build_with(per_rank_ids):
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    ids = per_rank_ids[dist.get_rank()]
    err = _catch(lambda: bdcp.BlockDiagCPState.build(ids, attn_backend="dense"))
    # Prove nobody is stuck in a collective: a barrier after the error must pass.
    dist.barrier()
    return err


GOOD = torch.tensor([1] * 10 + [2] * 6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,ids0,ids1,needle", [
    ("float", GOOD.float(), GOOD.float(), "integer"),
    ("float_on_one_rank", GOOD, GOOD.float(), "integer"),
    ("negative", GOOD - 3, GOOD - 3, ">= 0"),
    ("3d", GOOD.view(1, 1, -1), GOOD.view(1, 1, -1), "shape"),
    ("length_differs", GOOD, GOOD[:12], "differ across the CP ranks"),
    ("content_differs", GOOD, GOOD.flip(0), "differ across the CP ranks"),
])
def test_bad_doc_ids_raise_on_every_rank(pool, name, ids0, ids1, needle):
    errs = pool.run(build_with, [ids0, ids1])
    for err in errs:
        assert err is not None and err[0] == "BlockDiagCPError" and needle in err[1], (name, errs)


def bad_qkv_and_knobs():
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    out = {}
    out["knob"] = _catch(lambda: bdcp.BlockDiagCPState.build(GOOD, kv_exchange="ring"))
    out["layout"] = _catch(lambda: bdcp.BlockDiagCPState.build(GOOD, layout="random"))
    state = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense")
    L = state.local_len

    def attn(q, k, v, **kw):
        with bdcp.blockdiag_cp_step(state):
            return bdcp.blockdiag_cp_attention(q, k, v, **kw)

    r = lambda *s: torch.randn(*s)  # noqa: E731
    out["len"] = _catch(lambda: attn(r(L + 1, 1, 4, 8), r(L + 1, 1, 2, 8), r(L + 1, 1, 2, 8)))
    # v's head dim may differ from k's (MLA's v_channels); its head count may not.
    out["kv"] = _catch(lambda: attn(r(L, 1, 4, 8), r(L, 1, 2, 8), r(L, 1, 1, 8)))
    out["gqa"] = _catch(lambda: attn(r(L, 1, 3, 8), r(L, 1, 2, 8), r(L, 1, 2, 8)))
    out["rows"] = _catch(lambda: bdcp.blockdiag_cp_attention(
        r(L, 2, 2, 8), r(L, 2, 2, 8), r(L, 2, 2, 8),
        state=bdcp.BlockDiagCPState.build(torch.stack([GOOD, GOOD, GOOD]), attn_backend="dense")))
    solo = dist.new_group([0])  # collective: every rank creates it, only rank 0 is a member
    if dist.get_rank() == 0:
        out["group"] = _catch(lambda: attn(r(L, 1, 2, 8), r(L, 1, 2, 8), r(L, 1, 2, 8), cp_group=solo))
    out["no_state"] = _catch(lambda: bdcp.blockdiag_cp_attention(r(L, 1, 2, 8), r(L, 1, 2, 8),
                                                                  r(L, 1, 2, 8)))
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_bad_qkv_knobs_group_and_missing_state(pool):
    for rank, out in enumerate(pool.run(bad_qkv_and_knobs)):
        # Knob errors are agreed like every other input error: BlockDiagCPError on every rank.
        assert out["knob"][0] == "BlockDiagCPError" and "'ring'" in out["knob"][1]
        assert out["layout"][0] == "BlockDiagCPError" and "accepted values" in out["layout"][1]
        assert "local_len" in out["len"][1]
        assert "disagree" in out["kv"][1]
        assert "multiple" in out["gqa"][1]
        assert "rows" in out["rows"][1]
        if rank == 0:
            assert "size 1" in out["group"][1] and "cp=2" in out["group"][1]
        assert "no step state" in out["no_state"][1]
