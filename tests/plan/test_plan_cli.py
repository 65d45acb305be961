"""The planner CLI (``python -m megatron_ext.plan``): refusals before any work, the pretrain script's
blended --data-path, and a plot only where asked."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatron_ext.plan.__main__ import PLAN_BYTES_PER_RANK_PAIR, main, parse_args, sample_sequences
from megatron_ext.training.data import EOD, validate_indexed_dataset


def _dataset(folder, name, low, high, docs=20, seed=0):
    """An indexed dataset of `docs` random documents with byte values in [low, high)."""
    from megatron_ext.training.data import write_indexed_dataset

    g = torch.Generator().manual_seed(seed)
    files = []
    for i, n in enumerate(torch.randint(200, 700, (docs,), generator=g).tolist()):
        f = folder / f"{name}{i}.txt"
        f.write_bytes(bytes(torch.randint(low, high, (n,), generator=g).tolist()))
        files.append(f)
    prefix = str(folder / name)
    write_indexed_dataset(files, prefix, progress=False)
    return prefix


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan_data")
    return _dataset(folder, "low", 0, 128), _dataset(folder, "high", 128, 256, seed=1)


def _refusal(capsys, argv):
    t = time.monotonic()
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert time.monotonic() - t < 5  # up front: no sampling, no plan
    assert info.value.code == 2  # argparse's usage error
    return capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cp,seq", [(2048, 1024), (100000, 1024), (1025, 1024)])
def test_cp_above_the_sequence_length_is_refused_up_front(two_datasets, capsys, cp, seq):
    err = _refusal(capsys, ["--data-path", two_datasets[0], "--seq-length", str(seq), "--cp", str(cp)])
    assert f"--cp {cp} exceeds --seq-length {seq}" in err and f"at most {seq}" in err, err


@pytest.mark.timeout(60)
def test_a_plan_too_large_for_this_machine_is_refused_before_allocating(two_datasets, capsys):
    # cp 100000 of a 200000-token sequence: [cp, cp] tables of 1e10 entries, terabytes.
    err = _refusal(capsys, ["--data-path", two_datasets[0], "--seq-length", "200000", "--cp", "100000"])
    assert "--cp 100000: planning would need about 7.0 TiB" in err, err
    assert "more than the" in err and "available; plan a --cp of at most about" in err, err


@pytest.mark.timeout(120)
def test_the_memory_estimate_bounds_a_real_plan():
    # The refusal's bytes per pair of ranks bound what a plan really holds: the peak resident set of
    # one plan_summary over the set before it, in a fresh process (torch's allocations included,
    # which tracemalloc would miss), at a cp where the [cp, cp] tables dominate. Linux only.
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to restart the peak resident set")
    code = """
import torch
import megatron_ext.blockdiag_cp as bdcp
def kib(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field))
cp = 512
ids = torch.repeat_interleave(torch.arange(9), torch.tensor([300, 5, 700, 2, 64, 400, 333, 200, 44]))
bdcp.plan_summary(ids, 4, layout="balanced")  # imports and one-time costs out of the way
before = kib("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from the resident set now
bdcp.plan_summary(ids, cp, layout="balanced")
print((kib("VmHWM:") - before) * 1024)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    grown = int(res.stdout.split()[-1])
    assert 0 < grown < PLAN_BYTES_PER_RANK_PAIR * 512 ** 2, grown


@pytest.mark.timeout(120)
def test_blended_data_path_as_the_pretrain_script_takes_it(two_datasets, capsys, tmp_path, monkeypatch):
    low, high = two_datasets
    monkeypatch.chdir(tmp_path)
    assert main(["--data-path", "0.5", low, "0.5", high + ".bin", "--seq-length", "512", "--cp", "2",
                 "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert f"samples from 0.5 {low} 0.5 {high}.bin" in out and "balanced" in out, out
    args = parse_args(["--data-path", "0.5", low, "0.5", high + ".bin", "--seq-length", "512", "--cp", "2"])
    assert (args.data_prefixes, args.data_weights) == ([low, high], [0.5, 0.5])
    # Each sample comes from one dataset, picked by weight (without weights by token count, as
    # megatron blends by size): low's bytes are < 128, high's >= 128 (EOD ends documents of both).
    tokens = [validate_indexed_dataset(p)[1] for p in (low, high)]
    for weights, expected in (([0.9, 0.1], 0.9), ([1.0, 3.0], 0.25), (None, tokens[0] / sum(tokens))):
        samples = [s[s != EOD] for s in sample_sequences([low, high], 256, 400, 0, weights)]
        assert all(bool((s < 128).all()) or bool((s >= 128).all()) for s in samples)
        from_low = np.mean([bool((s < 128).all()) for s in samples])
        assert abs(from_low - expected) < 5 * (expected * (1 - expected) / 400) ** 0.5, (weights, from_low)
    # The pretrain script's messages for a malformed blend or a missing dataset.
    for bad, message in ((["0.5", low, "0.5"], "the weight 0.5 has no prefix after it"),
                         (["0.5", low, "0.5", str(tmp_path / "nope")], "missing")):
        with pytest.raises(SystemExit) as info:
            parse_args(["--data-path", *bad, "--seq-length", "512", "--cp", "2"])
        assert info.value.code == 2
        assert message in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # nothing written into the working directory unasked


@pytest.mark.timeout(120)
def test_the_plot_is_written_only_where_asked(two_datasets, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--data-path", two_datasets[0], "--seq-length", "512", "--cp", "2", "--samples", "1"]
    assert main(argv) == 0
    assert os.listdir(tmp_path) == [] and "wrote" not in capsys.readouterr().out
    plot = tmp_path / "out" / "plan.png"
    plot.parent.mkdir()
    assert main([*argv, "--plot", str(plot)]) == 0
    assert f"wrote {plot}" in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.timeout(120)
def test_the_exchange_options_table_sets_1d_and_2d_side_by_side(two_datasets, capsys, tmp_path, monkeypatch):
    # cp 8 on 2 nodes of 4: 1-D allgather / a2a / halo / hierarchical / ulysses, 2-D u 2 (outer a2a
    # and hierarchical: two groups per node) and u 4 (outer a2a over IB); 6 K/V heads: u 4 repeats them.
    monkeypatch.chdir(tmp_path)
    assert main(["--data-path", two_datasets[0], "--seq-length", "2048", "--cp", "8", "--nodes", "2",
                 "--heads", "12", "--kv-heads", "6", "--samples", "1"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("exchange options"):].splitlines()
    names = [line.split()[0] if not line.startswith("2d") else " ".join(line.split()[:5]) for line in table[2:]]
    assert names == ["allgather", "a2a", "halo", "hierarchical", "ulysses", "2d u2 x r4 a2a",
                     "2d u2 x r4 hierarchical", "2d u4 x r2 a2a"], table
    assert "balanced" in out[:out.index("exchange options")]  # the per-layout table stays
    ulysses = next(line for line in table if line.startswith("ulysses"))
    assert "12 % 8 = 4" in ulysses  # 1-D ulysses refused with the numbers
    two_d = next(line for line in table if line.startswith("2d u4 x r2 a2a")).split()
    mib, ib_mib, ms, over = (float(x) for x in two_d[5:9])
    assert 0 < ib_mib <= mib and ms > 0 and over >= 1.0, two_d
