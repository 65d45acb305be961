"""Fingerprints of prepared plans: one hash per (mix, layout, cp, topology, rank), to show a refactor
left every plan bit-identical.

For a fixed set of mixes (``megatron_ext.testing.mixes`` and the bench's scale mixes) x layouts
(contiguous, zigzag, balanced, thd) x CP sizes (one node and two levels at 8 ranks per node, with the
hierarchical exchange's routes), ``prepare_plan`` runs for the ranks listed in ``ranks_for`` and every
tensor, array and value reachable from the ``PreparedPlan`` (layout runs, positions, the plan's
exchange tables and streamed steps of every chunk kind, routes, windowed plans) is hashed in a fixed
walk order; host timings are left out. Balanced's choice label (which candidate the search kept) is
kept too, as is.

    python scripts/plan_fingerprint.py --out /tmp/before.json        # write
    python scripts/plan_fingerprint.py --check /tmp/before.json      # compare; exit 1 on any change
"""

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Dict, Iterator, List, Tuple

import numpy as np
import torch

_SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_SCRIPTS), os.path.join(_SCRIPTS, "bench")]  # this checkout's package first

from megatron_ext.blockdiag_cp import CostModel, WindowMix, prepare_plan  # noqa: E402
from megatron_ext.testing.mixes import (make_doc_ids, mix_name, packed_mix, worst_case_doc_ids,  # noqa: E402
                                        worst_case_mix_params)
from scale import thd_padded  # noqa: E402
from scale_mixes import SCALE_MIXES, scale_doc_ids  # noqa: E402

LAYOUTS = ("contiguous", "zigzag", "balanced", "thd")
TIMINGS = {"layout_seconds", "plan_seconds"}  # host clock readings: not part of the plan
SEPARATE = {"layout_choice"}  # balanced's choice label: its own entry (``|choice``), whichever way it is read
GPUS_PER_NODE = 8


def _update(h, obj, seen: set) -> None:
    """Feed ``obj`` into the hash ``h``, recursing through containers, dataclasses and plain objects."""
    if obj is None or isinstance(obj, (bool, int, str)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    elif isinstance(obj, float):
        h.update(f"float:{obj.hex()};".encode())
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"tensor:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        h.update(f"ndarray:{a.dtype}:{a.shape};".encode())
        h.update(a.tobytes())
    elif isinstance(obj, np.generic):
        _update(h, obj.item(), seen)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__}[{len(obj)}](".encode())
        for x in obj:
            _update(h, x, seen)
        h.update(b")")
    elif isinstance(obj, Mapping):  # a plan's lazy stream map builds every kind here
        keys = list(obj.keys())
        h.update(f"map[{len(keys)}](".encode())
        for k in keys:
            _update(h, k, seen)
            _update(h, obj[k], seen)
        h.update(b")")
    elif callable(obj) and not dataclasses.is_dataclass(obj) and not hasattr(obj, "__dict__"):
        h.update(f"callable:{getattr(obj, '__qualname__', type(obj).__name__)};".encode())
    else:
        if id(obj) in seen:
            h.update(b"<seen>")
            return
        seen.add(id(obj))
        if dataclasses.is_dataclass(obj):
            fields = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
        else:
            fields = sorted((k, v) for k, v in vars(obj).items() if not callable(v) or hasattr(v, "__dict__"))
        h.update(f"{type(obj).__name__}(".encode())
        for name, value in fields:
            if name in TIMINGS or name in SEPARATE or callable(value) and not dataclasses.is_dataclass(value) \
                    and not isinstance(value, Mapping):
                continue
            h.update(f"{name}=".encode())
            _update(h, value, seen)
        h.update(b")")


def fingerprint(obj) -> str:
    h = hashlib.sha256()
    _update(h, obj, set())
    return h.hexdigest()


def _choice_label(prep) -> str:
    """Balanced's chosen candidate, wherever this version of the code reports it."""
    label = getattr(prep, "layout_choice", None)
    if label is not None:
        return label
    try:  # the module-global hand-off of older code, in its two places
        from megatron_ext.blockdiag_cp.layouts import balanced
    except ImportError:
        from megatron_ext.blockdiag_cp import balanced
    return balanced.LAST_CHOICE[0] if prep.layout.name == "balanced" and prep.cp > 1 else prep.layout.name


def ranks_for(cp: int, S: int) -> List[int]:
    """Every rank of small plans; the first, second, middle and last of large ones (a plan is per rank,
    the layout the same for all)."""
    if cp <= 4:
        return list(range(cp))
    return sorted({0, 1, cp // 2, cp - 1})


def mixes(quick: bool) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, ids [S] or [R, S]) of the fixed set."""
    for S in (4096, 16384):
        for mix in ("short", "heavy_tail", "single"):
            yield f"{mix}@{S}", make_doc_ids(mix, S)
    yield "packed_mix@8192", packed_mix(8192, seed=3, min_len=8, max_len=3000, pad_tail=300)
    for p in worst_case_mix_params(4):
        yield f"worst:{mix_name(p)}@32768", worst_case_doc_ids(p, 32768)
    for S in (32768, 131072):
        for mix in SCALE_MIXES:
            yield f"scale:{mix}@{S}", scale_doc_ids(mix, S)
    rows = torch.stack([make_doc_ids("short", 8192, seed=1), make_doc_ids("heavy_tail", 8192, seed=2)])
    yield "two_rows@8192", rows


def points(quick: bool) -> Iterator[Tuple[str, torch.Tensor, int, str, dict]]:
    """(key, ids, cp, layout, prepare_plan kwargs) of every fingerprinted plan."""
    for name, ids in mixes(quick):
        S = ids.shape[-1]
        for cp in (2, 4, 8, 16):
            if S // cp < 256:
                continue
            topologies = [("nvlink", dict(cost_model=CostModel.preset("nvlink")))]
            if cp > GPUS_PER_NODE:
                topologies = [("2lvl", dict(cost_model=CostModel.two_level(GPUS_PER_NODE),
                                            kv_exchange="hierarchical", ranks_per_node=GPUS_PER_NODE)),
                              ("ib", dict(cost_model=CostModel.preset("ib")))]
            for topo, kw in topologies:
                for layout in LAYOUTS:
                    if layout == "thd" and ids.dim() == 2:
                        continue  # thd takes one row of ids
                    x = thd_padded(ids, cp) if layout == "thd" else ids
                    yield f"{name}|{layout}|cp{cp}|{topo}", x, cp, layout, kw
        if name in ("heavy_tail@16384", "scale:lognormal@32768") and ids.dim() == 1:
            # Windowed pricing (a mix of sliding-window and full layers) and one sliding window.
            for wname, windows in (("mix", WindowMix(((512, 0.5), (None, 0.5)))), ("w1024", 1024)):
                for cp in (4, 16):
                    kw = dict(cost_model=CostModel.two_level(GPUS_PER_NODE) if cp > GPUS_PER_NODE
                              else CostModel.preset("nvlink"), windows=windows)
                    yield f"{name}|balanced|cp{cp}|{wname}", ids, cp, "balanced", kw
    if not quick:
        ids = scale_doc_ids("heavy", 1 << 20)
        kw = dict(cost_model=CostModel.two_level(GPUS_PER_NODE), kv_exchange="hierarchical",
                  ranks_per_node=GPUS_PER_NODE)
        for layout in ("zigzag", "balanced"):
            yield f"scale:heavy@1048576|{layout}|cp64|2lvl", ids, 64, layout, kw


def run(quick: bool = False, log=print) -> Dict[str, str]:
    out: Dict[str, str] = {}
    t0 = time.perf_counter()
    for key, ids, cp, layout, kw in points(quick):
        ranks = [0, cp - 1] if ids.shape[-1] >= (1 << 20) else ranks_for(cp, ids.shape[-1])
        labels = set()
        for rank in ranks:
            prep = prepare_plan(ids, cp, rank, layout=layout, **kw)
            out[f"{key}|r{rank}"] = fingerprint(prep)
            labels.add(_choice_label(prep))
        assert len(labels) == 1, (key, labels)  # every rank lays out the same way
        out[f"{key}|choice"] = labels.pop()  # the label itself: readable in a diff
    log(f"{len(out)} fingerprints in {time.perf_counter() - t0:.1f}s")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the fingerprints (JSON) here")
    parser.add_argument("--check", help="compare against this earlier output; exit 1 on any difference")
    parser.add_argument("--quick", action="store_true", help="leave out the 1M / cp 64 points")
    args = parser.parse_args()
    if not args.out and not args.check:
        parser.error("give --out FILE, --check FILE, or both")
    torch.set_num_threads(1)
    got = run(args.quick)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(got, f, indent=0, sort_keys=True)
    if args.check:
        with open(args.check) as f:
            want = json.load(f)
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        changed = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        for k in changed[:20]:
            print("changed:", k)
        if missing or extra:
            print(f"missing: {missing[:10]} ({len(missing)}), extra: {extra[:10]} ({len(extra)})")
        if changed or missing or extra:
            print(f"FAIL: {len(changed)} of {len(want)} fingerprints changed, {len(missing)} missing, "
                  f"{len(extra)} extra")
            return 1
        print(f"OK: all {len(want)} fingerprints identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
