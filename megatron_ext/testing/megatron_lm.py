"""Megatron-LM's own ``pretrain_gpt.py`` on CPU processes, against a single-process reference.

Run as ``python -m megatron_ext.testing.megatron_lm --checkout DIR --out FILE [--scenarios ...]``
with ``DIR`` (a writable copy of a Megatron-LM checkout) first on ``PYTHONPATH`` and the current
directory set to it; ``tests/megatron_lm/test_megatron_lm.py`` does that. The parent process imports
Megatron-LM once (``pretrain_gpt`` and what it imports), then forks the ranks of each scenario
and, for numeric scenarios, one reference process. Every rank runs Megatron-LM's own pieces:

- ``megatron.training.arguments.parse_and_validate_args`` on the scenario's command line (with
  ``extra_args_provider=megatron_ext.megatron_lm.extra_args_provider`` where the scenario uses
  our flags: the one line a user adds; without it, as ``pretrain_gpt.py`` calls it);
- both of its model-builder routes: ``get_model(partial(model_provider, gpt_builder))`` (the
  legacy route) and ``GPTModelBuilder(gpt_config_from_args(args)).build_distributed_models``;
- its dataset (``pretrain_gpt.train_valid_test_datasets_provider``: ``MockGPTDataset`` or
  ``GPTDataset`` over an indexed dataset written by megatron's ``IndexedDatasetBuilder``) and
  data loader (``build_pretraining_data_loader``);
- megatron-core's schedule (``get_forward_backward_func``: no pipelining, or the interleaved
  1F1B with virtual stages) calling ``pretrain_gpt.forward_step`` (``get_batch``,
  ``get_batch_on_this_cp_rank``, the model) and ``pretrain_gpt.loss_func``, then backward.

The reference is one process (CP = 1, PP = 1) running the same Megatron-LM with megatron's
own core attention (``DotProductAttention``, no ``--spec``) on the same samples, documents from
``--reset-attention-mask`` (the mask megatron's dataset builds), with the CP run's weights.
Losses are per-token sums (``--calculate-per-token-loss``), so the CP ranks' loss sums and
gradients add up to the reference's.

``CUDA_PATCHES`` is the one list of what is patched: CUDA calls only (no GPU here).
"""

import argparse
import functools
import json
import multiprocessing
import os
import pathlib
import socket
import sys
import traceback

# ---------------------------------------------------------------------------
# CUDA calls, patched (the whole list)
# ---------------------------------------------------------------------------


def _cpu_rng_state(*args, **kwargs):
    import torch

    return torch.get_rng_state()


def _set_cpu_rng_state(state, *args, **kwargs):
    import torch

    torch.set_rng_state(state)


def _manual_cpu_seed(seed):
    import torch

    torch.manual_seed(seed)


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.split(":")[0] == "cuda") or \
        getattr(device, "type", None) == "cuda"


def cuda_tensors_on_cpu():
    """A torch function mode: ``device="cuda"`` (factories, ``.to``) means the CPU; no pinned memory."""
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaTensorsOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = torch.device("cpu")
            if kwargs.get("pin_memory"):  # page-locked host memory is a CUDA feature
                kwargs["pin_memory"] = False
            if func is torch.Tensor.pin_memory:
                return args[0]
            if func in (torch.Tensor.to, torch.Tensor.cuda) and any(_is_cuda(a) for a in args[1:]):
                args = tuple(torch.device("cpu") if _is_cuda(a) else a for a in args)
            return func(*args, **kwargs)

    return CudaTensorsOnCpu()


CUDA_PATCHES = (
    # (module, attribute, replacement, why)
    ("torch.nn.Module", "cuda", lambda self, device=None: self,
     "get_model / build_distributed_models move every chunk to the GPU"),
    ("torch.Tensor", "cuda", lambda self, *a, **k: self, "get_batch moves the batch to the GPU"),
    ("torch.cuda", "current_device", lambda: __import__("torch").device("cpu"),
     "buffers allocated on the current device (batch broadcast, pipeline p2p)"),
    ("torch.cuda", "synchronize", lambda *a, **k: None,
     "the non-interleaved pipeline schedule's batched p2p waits for the GPU stream"),
    ("torch.cuda", "get_rng_state", _cpu_rng_state, "the model-parallel RNG tracker's states"),
    ("torch.cuda", "set_rng_state", _set_cpu_rng_state, "the model-parallel RNG tracker's states"),
    ("torch.cuda", "manual_seed", _manual_cpu_seed, "model_parallel_cuda_manual_seed"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _cpu_rng_state,
     "the RNG tracker's fork reads the CUDA generator"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _set_cpu_rng_state,
     "the RNG tracker's fork sets the CUDA generator"),
    ("megatron.training.arguments", "get_device_arch_version", lambda: 9,
     "validate_args asks the GPU's architecture (9: Hopper)"),
    ("torch", "(function mode)", cuda_tensors_on_cpu,
     "tensors created with device='cuda' (the schedules' token counters) are created on the CPU, "
     "pin_memory (RoPE's CP index) is dropped; entered in every rank"),
)


def apply_cuda_patches() -> None:
    import importlib

    import torch

    for module, attr, replacement, _ in CUDA_PATCHES:
        if attr == "(function mode)":
            continue  # a mode is entered per process (run_rank), not set as an attribute
        target = {"torch.nn.Module": torch.nn.Module, "torch.Tensor": torch.Tensor}.get(module)
        if target is None:
            target = importlib.import_module(module)
        setattr(target, attr, replacement)


def install_compiled_helpers(checkout: pathlib.Path) -> None:
    """Copy the installed megatron-core's compiled dataset helpers into the checkout copy."""
    import glob
    import shutil
    import site

    dest = checkout / "megatron" / "core" / "datasets"
    if glob.glob(str(dest / "helpers_cpp*.so")):
        return
    for root in site.getsitepackages():
        found = glob.glob(os.path.join(root, "megatron", "core", "datasets", "helpers_cpp*.so"))
        if found:
            shutil.copy(found[0], dest)
            return
    raise RuntimeError("no compiled helpers_cpp*.so in an installed megatron-core; install megatron-core "
                       "(>= 0.19 for Python 3.12) in this interpreter")


# ---------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------

VOCAB = 13  # NullTokenizer: eod = 12, and MockGPTDataset's tokens cycle through it every 13 tokens
SEQ = 64

BASE = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
    "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-4", "--seed", "1234",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--split", "100,0,0",
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
    "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--untie-embeddings-and-output-weights",
    "--calculate-per-token-loss", "--num-workers", "0", "--eval-iters", "0",
]
SPEC = ["--spec", "megatron_ext.layers", "blockdiag_cp_gpt_layer_spec"]
MASK = ["--reset-attention-mask", "--reset-position-ids"]
THD = ["--dataloader-inter-document-masking", "--reset-position-ids"]
MOCK = ["--mock-data"]
DATA = ["--data-path", "{data}"]


def _scenario(name, world, cp, argv, ours=False, reference=True, pp=1, expect_error=None, control=False,
              env=None):
    """``env``: environment of the scenario's ranks (e.g. LOCAL_WORLD_SIZE: processes per "node")."""
    return {"name": name, "world": world, "cp": cp, "pp": pp, "argv": argv, "ours": ours,
            "reference": reference, "expect_error": expect_error, "control": control, "env": env or {}}


SCENARIOS = {s["name"]: s for s in (
    # The attention-mask path (megatron's mask, cut zigzag by get_batch_on_this_cp_rank).
    _scenario("mask", 2, 2, BASE + SPEC + MASK + MOCK + ["--context-parallel-size", "2"], control=True),
    # THD: --dataloader-inter-document-masking, cu_seqlens cut per sequence.
    _scenario("thd", 2, 2, BASE + SPEC + THD + DATA + ["--context-parallel-size", "2"], control=True),
    _scenario("qk_layernorm", 2, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--qk-layernorm", "--position-embedding-type", "rope",
        "--normalization", "RMSNorm"]),
    _scenario("moe", 2, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-layer-freq", "[0,1]", "--swiglu", "--disable-bias-linear"]),
    # MoE under PP = 2 (4 layers, 2 per stage): --moe-layer-freq counts global layers, so the second
    # stage's layers 3, 4 are MoE, dense ([0,1,1,0]); numbered per stage they would be dense, MoE.
    _scenario("moe_pp", 4, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1,1,0]", "--swiglu",
        "--disable-bias-linear"], pp=2),
    # PP = 2 with 2 virtual stages each (4 layers, one per chunk) x CP = 2: four processes.
    _scenario("pp_vp_thd", 4, 2, BASE + SPEC + THD + DATA + [
                  "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                  "--num-layers-per-virtual-pipeline-stage", "1", "--num-layers", "4"], pp=2),
    _scenario("pp_vp_mask", 4, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers-per-virtual-pipeline-stage", "1", "--num-layers", "4"], pp=2, reference=False,
        expect_error="pipeline middle stages"),
    # Megatron's own flags drive our knobs (no extra_args_provider: pretrain_gpt.py as shipped).
    _scenario("megatron_flags", 2, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--attention-backend", "unfused", "--cp-comm-type", "a2a"]),
    # Ours, through the one extra line (extra_args_provider).
    _scenario("our_flags", 2, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--cp-attn-backend", "sdpa", "--cp-kv-exchange", "all-gather",
        "--cp-kv-backward", "refetch", "--cp-attn-backend-strict"], ours=True),
    # Ours on the THD path: the batch's zigzag rows moved to the balanced layout for the attention.
    _scenario("thd_relayout", 2, 2, BASE + SPEC + THD + DATA + [
        "--context-parallel-size", "2", "--cp-kv-exchange", "a2a", "--cp-relayout", "balanced"], ours=True),
    _scenario("our_flags_unknown_without_provider", 2, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--cp-kv-exchange", "a2a"], reference=False,
        expect_error="unrecognized arguments: --cp-kv-exchange a2a"),
    # Our two-level exchange: CP = 4 as 2 "nodes" of 2 ranks (LOCAL_WORLD_SIZE=2, node-major ranks),
    # where a node's remote rows cross once; and CP = 2 on one node, where it falls back to a2a.
    _scenario("hierarchical", 4, 4, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "4", "--cp-kv-exchange", "hierarchical"], ours=True,
        env={"LOCAL_WORLD_SIZE": "2"}),
    _scenario("hierarchical_one_node", 2, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--cp-kv-exchange", "hierarchical"], ours=True, reference=False,
        env={"LOCAL_WORLD_SIZE": "2"}),
    # Refused by Megatron-LM's own validate_args before our layer is built (TE >= 2.9 is not here; our
    # layer refuses it naming --qk-clip where Megatron-LM lets it through: tests/layers/test_layer_config.py).
    _scenario("qk_clip", 2, 2, BASE + SPEC + MASK + MOCK + ["--context-parallel-size", "2", "--qk-clip"],
              reference=False, expect_error="--qk-clip is only supported with TE"),
    _scenario("conflict", 2, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--cp-kv-exchange", "a2a", "--cp-comm-type", "allgather"],
        ours=True, reference=False, expect_error="disagree"),
    # Megatron's a2a+p2p: two-dimensional CP, Ulysses inside groups of 2 CP ranks (megatron-core's
    # hierarchical CP groups, level 0), p2p (our halo, or a2a where halo does not apply) between the 2.
    _scenario("a2a_p2p", 4, 4, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
        "2", "2"]),
    _scenario("a2a_p2p_thd", 4, 4, BASE + SPEC + THD + DATA + [
        "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
        "2", "2"]),
    # Three levels have no two-dimensional reading: refused, naming the flag.
    _scenario("a2a_p2p_three_levels", 2, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
        "2", "1", "1"], reference=False, expect_error="a2a+p2p"),
    _scenario("attention_backend_local", 2, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--attention-backend", "local"], reference=False,
        expect_error="--attention-backend local"),
    _scenario("strict_fallback", 2, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--cp-attn-backend", "te", "--cp-attn-backend-strict"],
        ours=True, reference=False, expect_error="strict mode"),
    _scenario("mla", 2, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--multi-latent-attention", "--q-lora-rank", "16",
        "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
        "--position-embedding-type", "rope"], reference=False),  # megatron's local attention takes no MLA
    _scenario("no_mask_in_dataloader", 2, 2, BASE + SPEC + MASK + MOCK + [
        "--context-parallel-size", "2", "--no-create-attention-mask-in-dataloader"], reference=False,
        expect_error="--no-create-attention-mask-in-dataloader"),
)}


def reference_argv(argv, control=False):
    """The scenario's command line at CP = 1, PP = 1, megatron's own core attention, its mask.

    ``control``: the same without document masking (plain causal over each sample), which the CP
    run must NOT match: it shows the comparison sees the documents.
    """
    out, skip = [], 0
    drop_with_value = {"--context-parallel-size": 1, "--pipeline-model-parallel-size": 1,
                       "--num-layers-per-virtual-pipeline-stage": 1, "--spec": 2,
                       "--attention-backend": 1, "--cp-comm-type": 1,
                       "--hierarchical-context-parallel-sizes": 2}
    for i, a in enumerate(argv):
        if skip:
            skip -= 1
            continue
        if a in drop_with_value:
            skip = drop_with_value[a]
            continue
        if a in ("--dataloader-inter-document-masking",):
            out += [] if control else ["--reset-attention-mask"]
            continue
        if a == "--reset-attention-mask" and control:
            continue
        if a.startswith("--cp-"):
            skip = 0 if a == "--cp-attn-backend-strict" else 1
            continue
        out.append(a)
    return out


# ---------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------


def _global_param_names(model):
    """{local parameter name: name with the decoder layer's global index}."""
    import re

    names = {}
    layers = model.decoder.layers if hasattr(model, "decoder") else []
    for name, _ in model.named_parameters():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if m:
            name_global = f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}.{m.group(2)}"
        else:
            name_global = name
        names[name] = name_global
    return names


def _build_both_routes(args):
    """Megatron-LM's two builder routes: the legacy model_provider(gpt_builder) and GPTModelBuilder."""
    from gpt_builders import gpt_builder
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.training import get_model
    from model_provider import model_provider

    legacy = get_model(functools.partial(model_provider, gpt_builder), wrap_with_ddp=False)
    builder_cls = gpt_config_from_args(args).get_builder_cls()
    builder = builder_cls(gpt_config_from_args(args))
    modern = builder.build_distributed_models(pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                                              wrap_with_ddp=False)
    return {"legacy": legacy, "builder": modern}


def _describe(chunks):
    """What each layer was built with (our core attention, its norms, MLP kind)."""
    from megatron_ext.layers import BlockDiagCPAttention

    out = []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            attn = layer.self_attention
            out.append({
                "layer": layer.layer_number,
                "layer_class": type(layer).__name__,
                "self_attention": type(attn).__name__,
                "core_attention": type(attn.core_attention).__name__,
                "ours": isinstance(attn.core_attention, BlockDiagCPAttention),
                "q_layernorm": type(getattr(attn, "q_layernorm", None)).__name__,
                "k_layernorm": type(getattr(attn, "k_layernorm", None)).__name__,
                "mlp": type(layer.mlp).__name__,
            })
    return out


def _data_iterators(args, n_chunks):
    import pretrain_gpt
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    train_ds, _, _ = pretrain_gpt.train_valid_test_datasets_provider(
        [args.global_batch_size * args.train_iters, 0, 0])
    return [iter(build_pretraining_data_loader(train_ds, 0)) for _ in range(n_chunks)]


def _train_step(args, chunks):
    """One step of megatron-core's schedule over Megatron-LM's forward_step / loss_func; loss sum."""
    import pretrain_gpt
    import torch
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
        chunk.train()
    iterators = _data_iterators(args, len(chunks))
    losses = get_forward_backward_func()(
        forward_step_func=pretrain_gpt.forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length,
        forward_only=False)
    total = torch.zeros(2, dtype=torch.float64)
    for report in losses:
        total += report["lm loss"].double()
    return total.tolist()  # [loss sum, tokens] over this rank's micro batches


def _params_and_grads(chunks):
    params, grads = {}, {}
    for chunk in chunks:
        names = _global_param_names(chunk)
        for name, p in chunk.named_parameters():
            params[names[name]] = p.detach().clone()
            grads[names[name]] = (p.grad if p.grad is not None else _zeros_like(p)).detach().clone()
    return params, grads


def _zeros_like(p):
    import torch

    return torch.zeros_like(p)


def _load(chunks, params):
    import torch

    with torch.no_grad():
        for chunk in chunks:
            names = _global_param_names(chunk)
            for name, p in chunk.named_parameters():
                p.copy_(params[names[name]])


def _init(rank, world, port, argv, ours, env=None):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), **(env or {}))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sys.argv = ["pretrain_gpt.py"] + argv
    from megatron.core import mpu, tensor_parallel
    from megatron.training.arguments import parse_and_validate_args

    import megatron_ext.megatron_lm as mlm

    args = parse_and_validate_args(extra_args_provider=mlm.extra_args_provider if ours else None,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)  # as initialize_megatron does
    return args


def _record_states():
    """Keep the reports of the step states the layer resolves (what actually ran)."""
    import megatron_ext.layers.attention as attention

    seen = []
    original = attention.resolve_step_state

    def recording(*a, **k):
        state = original(*a, **k)
        if state is not None and (not seen or seen[-1] is not state):
            seen.append(state)
        return state

    attention.resolve_step_state = recording
    return seen


def run_rank(scenario, rank, world, port, data, params, queue, control=False):
    import contextlib
    import io

    mode = cuda_tensors_on_cpu()
    mode.__enter__()
    stderr = io.StringIO()
    try:
        argv = [a.replace("{data}", data) for a in scenario["argv"]]
        if params is not None:  # the reference
            argv = reference_argv(argv, control)
        try:
            with contextlib.redirect_stderr(stderr):  # argparse's own error, kept for the report
                args = _init(rank, world, port, argv, scenario["ours"] and params is None,
                             scenario["env"] if params is None else None)
        except SystemExit as exc:
            raise RuntimeError(f"exit {exc.code} at parse_and_validate_args: "
                               f"{stderr.getvalue().strip().splitlines()[-1:]}") from None
        import megatron_ext.blockdiag_cp as bdcp

        states = _record_states()
        routes = _build_both_routes(args)
        knobs = dict(bdcp.cp_varlen_runtime_config(), **bdcp.cp_kv_backward_runtime_config(),
                     **bdcp.cp_strict_runtime_config(), **bdcp.cp_ulysses_size_runtime_config())
        out = {"rank": rank, "knobs": knobs, "layers": {r: _describe(c) for r, c in routes.items()},
               "cp": args.context_parallel_size, "pp": args.pipeline_model_parallel_size,
               "vp": args.virtual_pipeline_model_parallel_size}
        if params is not None:
            _load(routes["legacy"], params)
            out["loss"] = _train_step(args, routes["legacy"])
            out["params"], out["grads"] = _params_and_grads(routes["legacy"])
        else:
            start, _ = _params_and_grads(routes["legacy"])
            _load(routes["builder"], start)
            out["params"] = start
            out["routes"] = {}
            for route, chunks in routes.items():
                loss = _train_step(args, chunks)
                _, grads = _params_and_grads(chunks)
                out["routes"][route] = {"loss": loss, "grads": grads}
            out["states"] = [s.report() for s in states]
        queue.put(_to_bytes(out))
    except BaseException as exc:  # noqa: BLE001 - shipped to the parent
        queue.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()})


def _to_bytes(obj) -> bytes:
    """Tensors as plain bytes: torch's queue pickling shares file descriptors the exiting rank closes."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(blob):
    import io

    import torch

    if isinstance(blob, dict):
        return blob
    return torch.load(io.BytesIO(blob), weights_only=False)  # our own ranks' results


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_processes(scenario, world, data, params=None, timeout=300, control=False):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=run_rank, args=(scenario, r, world, port, data, params, queue, control))
             for r in range(world)]
    for p in procs:
        p.start()
    results = []
    import queue as queue_mod

    try:
        for _ in range(world):
            results.append(_from_bytes(queue.get(timeout=timeout)))
    except queue_mod.Empty:
        results.append({"rank": -1, "error": f"timeout: no result within {timeout}s"})
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    return sorted(results, key=lambda r: r["rank"])


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def run_scenario(scenario, data):
    import torch

    ranks = _run_processes(scenario, scenario["world"], data)
    errors = [r for r in ranks if "error" in r]
    summary = {"name": scenario["name"], "argv": " ".join(scenario["argv"]).replace(data, "<data>"),
               "extra_args_provider": scenario["ours"]}
    if errors:
        summary["errors"] = sorted({e["error"] for e in errors})
        summary["error_ranks"] = sorted(e["rank"] for e in errors)
        summary["traceback"] = errors[0].get("traceback", "")
        return summary
    summary["knobs"] = [r["knobs"] for r in ranks]
    summary["layers"] = ranks[0]["layers"]
    summary["layers_by_rank"] = [r["layers"] for r in ranks]
    summary["states"] = ranks[0]["states"]
    summary["states_by_rank"] = [r["states"] for r in ranks]
    summary["layout"] = {"cp": ranks[0]["cp"], "pp": ranks[0]["pp"], "vp": ranks[0]["vp"]}
    summary["loss_sums"] = {route: sum(float(r["routes"][route]["loss"][0]) for r in ranks)
                            for route in ("legacy", "builder") if all("routes" in r for r in ranks)}
    if not scenario["reference"]:
        return summary
    params = {}
    for r in ranks:
        params.update(r["params"])
    (ref,) = _run_processes(scenario, 1, data, params=params)
    if "error" in ref:
        summary["errors"] = [f"reference: {ref['error']}"]
        summary["traceback"] = ref.get("traceback", "")
        return summary
    summary["reference_layers"] = ref["layers"]
    summary["reference_loss"] = ref["loss"]
    if scenario["control"]:
        (ctl,) = _run_processes(scenario, 1, data, params=params, control=True)
        if "error" in ctl:
            summary["errors"] = [f"control: {ctl['error']}"]
            return summary
        summary["control_loss_rel_diff"] = abs(ctl["loss"][0] - ref["loss"][0]) / abs(ref["loss"][0])
        summary["control_grad_rel_diff"] = max(_rel(ctl["grads"][n], ref["grads"][n]) for n in ref["grads"])
    summary["routes"] = {}
    for route in ("legacy", "builder"):
        loss = torch.tensor([r["routes"][route]["loss"] for r in ranks], dtype=torch.float64).sum(0)
        grads = {}
        for r in ranks:
            for name, g in r["routes"][route]["grads"].items():
                grads[name] = grads.get(name, 0) + g
        # Every parameter lives on one PP stage and is replicated over CP: the sum over all ranks is
        # the sum over CP of its stage's gradients.
        missing = sorted(set(ref["grads"]) - set(grads))
        grad_errors = {n: _rel(grads[n], ref["grads"][n]) for n in ref["grads"] if n in grads}
        worst = max(grad_errors, key=grad_errors.get)
        summary["routes"][route] = {
            "loss_sum": float(loss[0]), "tokens": float(loss[1]),
            "loss_rel_err": abs(float(loss[0]) - ref["loss"][0]) / abs(ref["loss"][0]),
            "max_grad_rel_err": grad_errors[worst], "worst_param": worst,
            "params_compared": len(grad_errors), "reference_params": len(ref["grads"]),
            "missing_params": missing, "extra_params": sorted(set(grads) - set(ref["grads"])),
            "grad_norm": float(sum(float(g.double().pow(2).sum()) for g in grads.values()) ** 0.5),
        }
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", required=True, help="a writable copy of a Megatron-LM checkout")
    parser.add_argument("--out", required=True, help="JSON results")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    opts = parser.parse_args(argv)
    checkout = pathlib.Path(opts.checkout).resolve()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    os.environ.setdefault("NO_VCS_VERSION", "1")
    install_compiled_helpers(checkout)
    import warnings

    warnings.filterwarnings("ignore")
    import torch  # noqa: F401

    import pretrain_gpt  # noqa: F401 - Megatron-LM's entry point, imported once for every fork
    import megatron.core.tensor_parallel.random  # noqa: F401
    import megatron.training.arguments  # noqa: F401

    apply_cuda_patches()
    data = str(checkout.parent / "megatron_lm_docs")
    write_documents(data)
    results = {"megatron_core": __import__("megatron.core", fromlist=["__version__"]).__version__,
               "python": sys.version.split()[0], "torch": torch.__version__,
               "megatron_lm_flags": megatron_lm_flags(), "scenarios": {}}
    for name in opts.scenarios.split(","):
        results["scenarios"][name] = run_scenario(SCENARIOS[name], data)
        pathlib.Path(opts.out).write_text(json.dumps(results, indent=1, default=str))


def megatron_lm_flags() -> dict:
    """For each field of ``megatron_ext.megatron_lm.MEGATRON_LM_FLAGS``: the option strings of
    Megatron-LM's own parser (``add_megatron_arguments``) that store into that field's argument."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_ext.megatron_lm import MEGATRON_LM_ARG, MEGATRON_LM_FLAGS

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    by_dest = {}
    for action in parser._actions:
        by_dest.setdefault(action.dest, []).extend(action.option_strings)
    return {field: {"dest": MEGATRON_LM_ARG.get(field, field),
                    "options": by_dest.get(MEGATRON_LM_ARG.get(field, field), [])}
            for field in MEGATRON_LM_FLAGS}


def write_documents(prefix: str, n_docs: int = 120, seed: int = 7) -> None:
    """Short documents (1 to 24 tokens, EOD last) with megatron's own IndexedDatasetBuilder."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if os.path.exists(prefix + ".idx"):
        return
    g = torch.Generator().manual_seed(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for _ in range(n_docs):
        n = int(torch.randint(1, 25, (1,), generator=g))
        doc = torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() + [VOCAB - 1]
        builder.add_document(torch.tensor(doc, dtype=torch.int32), [len(doc)])
    builder.finalize(prefix + ".idx")


if __name__ == "__main__":
    main()
