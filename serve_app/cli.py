"""One command line: ``serve-app run | make-model | make-adapter | bench | keys | dashboards | vllm``.

``run`` starts a local Ray instance (or joins ``--address``), deploys the app from a deployment
YAML and serves until Ctrl-C, then shuts Serve and Ray down cleanly.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time
from pathlib import Path
from types import ModuleType

from serve_app.config import DEFAULT_CONFIG, AppConfig, ConfigError, load_config
from serve_app.models import MODEL_KINDS, write_model


def _examples(base_url: str, model: str, keyed: bool = False) -> str:
    """What to paste; with tenants configured the examples carry a key placeholder."""
    key = "$API_KEY" if keyed else "none"
    auth = " -H \"Authorization: Bearer $API_KEY\"" if keyed else ""
    note = ("\n  (tenants are configured: set API_KEY to a tenant's key, see `serve-app keys`)\n"
            if keyed else "")
    return f"""
Serving {model} at {base_url}
{note}
  curl {base_url}/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{base_url}', api_key='{key}'); \\
print(c.completions.create(model='{model}', prompt='Hello', max_tokens=32).choices[0].text)"

Press Ctrl-C to stop.
"""


def cmd_make_model(args: argparse.Namespace) -> int:
    out = Path(args.out or f"models/{'tiny-llama' if args.kind == 'tiny' else args.kind}")
    write_model(args.kind, out, seed=args.seed)
    print(f"wrote {args.kind} model to {out}")
    return 0


def cmd_make_adapter(args: argparse.Namespace) -> int:
    from serve_app.adapter_files import write_tiny_adapter

    write_tiny_adapter(Path(args.out), Path(args.base), seed=args.seed, rank=args.rank)
    print(f"wrote a rank-{args.rank} LoRA adapter of {args.base} to {args.out}")
    return 0


def _check_local_paths(cfg: AppConfig) -> int:
    for m in cfg.models:
        p = Path(m.path)
        if p.is_absolute() and not p.exists():
            print(f"model {m.name}: {p} does not exist; write it with "
                  f"`serve-app make-model <kind> --out {p}` or point `path` elsewhere",
                  file=sys.stderr)
            return 2
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from serve_app.launch import start_stack, stop_stack

    cfg_path = Path(args.config)
    try:
        cfg = load_config(cfg_path)
        if (rc := _check_local_paths(cfg)) != 0:
            return rc
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    if args.port:
        cfg = cfg.model_copy(update={"router": cfg.router.model_copy(update={"port": args.port})})
    stop = {"now": False}

    def _on_signal(signum: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        try:
            base = start_stack(cfg, address=args.address)
        except ConfigError as err:  # e.g. a port in use: named with the setting that moves it
            print(err, file=sys.stderr)
            return 2
        # ray.init replaced the SIGTERM handler with one that exits mid-call (seen on the GPU
        # host: the driver aborted while shutting down); ours again, so TERM shuts down cleanly.
        signal.signal(signal.SIGTERM, _on_signal)
        print(_examples(f"{base}/v1", cfg.models[0].name, keyed=bool(cfg.tenants)), flush=True)
        while not stop["now"]:
            time.sleep(0.5)
    finally:
        print("shutting down ...", flush=True)
        stop_stack()
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from serve_app.launch import deploy

    try:
        cfg = load_config(Path(args.config))
        if (rc := _check_local_paths(cfg)) != 0:
            return rc
        if args.port:
            cfg = cfg.model_copy(update={"router": cfg.router.model_copy(
                update={"port": args.port})})
        result = deploy(cfg, address=args.address)
    except (ConfigError, ValueError) as err:
        print(err, file=sys.stderr)
        return 2
    if result.mode == "live":
        print(f"tenants version {result.tenants_version} published: every router enforces it "
              "within about a second; nothing restarted")
    else:
        print(f"redeploying {args.config} (tenants version {result.tenants_version}): new "
              "replicas start, old ones finish their requests first; `serve-app status` shows "
              "progress")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from serve_app.launch import status

    print(json.dumps(status(address=args.address), indent=2))
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    """Sum the usage files per tenant and model (serve_app/governance/usage.py)."""
    import json

    from serve_app.governance.usage import (format_table, parse_since, read_records,
                                               summarize, usage_files)

    paths = list(args.file or [])
    if not paths:
        try:
            usage = load_config(Path(args.config)).governance.usage
        except ConfigError as err:
            print(err, file=sys.stderr)
            return 2
        if usage.dir is None:
            print(f"{args.config} sets no governance.usage.dir; name the usage files or "
                  "folder with --file", file=sys.stderr)
            return 2
        paths = [usage.dir]
    try:
        since = parse_since(args.since) if args.since else None
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    files = usage_files(paths)
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        print(f"no such usage file: {', '.join(missing)}", file=sys.stderr)
        return 2
    totals = summarize(read_records(files), since=since, tenant=args.tenant)
    if args.json:
        print(json.dumps([{"tenant": t, "model": m, "requests": u.requests, "errors": u.errors,
                           "prompt_tokens": u.prompt_tokens,
                           "completion_tokens": u.completion_tokens,
                           "cached_tokens": u.cached_tokens, "total_tokens": u.total_tokens}
                          for (t, m), u in sorted(totals.items())], indent=2))
    else:
        print(format_table(totals))
    return 0


# The benchmark tools: subcommand -> (module of the serve_bench package, its entry point, help).
# They live outside serve_app (bench/serve_bench/) so that editing them rolls no engine
# (serve_app.app.deployment_versions), and are imported only when their subcommand runs.
BENCH_COMMANDS: dict[str, tuple[str, str, str]] = {
    "bench": ("serve_bench.runner", "main",
              "benchmark an OpenAI endpoint (throughput, TTFT, TPOT, ITL)"),
    "flood": ("serve_bench.flood", "main",
              "a flooding tenant beside a quiet one: the quiet one's TTFT"),
    "chaos": ("serve_bench.chaos", "main", "faults and overload against a local stack "
              "(disconnect storm, replica kill, overload), with figures"),
    "simulate": ("serve_bench.simulate_report", "run", "admission at cluster scale on a "
                 "simulated clock (the real admission classes, modelled engines; no Ray): "
                 "utilisation, engine waiting, quiet tenant's wait per shape and event"),
}


def bench_module(name: str) -> ModuleType:
    """Import ``name`` from the serve_bench package. Installed (``pip install -e .``) it is on
    the path; a checkout run from its root without installing (``PYTHONPATH=.``, as on the
    GPU hosts) finds it in ``bench/`` beside this package."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        bench_dir = Path(__file__).resolve().parents[1] / "bench"
        if err.name != "serve_bench" or not (bench_dir / "serve_bench").is_dir():
            raise
        sys.path.insert(0, str(bench_dir))
        return importlib.import_module(name)


def cmd_bench_tool(args: argparse.Namespace) -> int:
    module, entry, _ = BENCH_COMMANDS[args.command]
    return int(getattr(bench_module(module), entry)(args))


def cmd_dashboards(args: argparse.Namespace) -> int:
    if args.push:
        from serve_app.observability.grafana_push import PushError, push_dashboards

        try:
            for d in push_dashboards(args.push, folder_uid=args.folder_uid):
                print(f"pushed {d.name}: uid {d.uid}, version {d.version} {d.url}")
        except PushError as err:
            print(err, file=sys.stderr)
            return 1
        return 0
    if args.preview:
        from serve_app.observability.previews import render_all

        out = Path(args.out if args.out != "dashboards" else "dashboards/previews")
        for name, panels in render_all(args.preview, out, args.range_s).items():
            empty = [title for title, n in panels.items() if not n]
            print(f"wrote {out / Path(name).stem}.png ({len(panels)} panels"
                  + (f"; no data: {', '.join(empty)})" if empty else ")"))
        return 0
    from serve_app.observability.dashboards import write_dashboards

    for path in write_dashboards(Path(args.out)):
        print(f"wrote {path}")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    """Print a fresh API key for ``args.tenant`` (give it to the tenant) and the config entry
    that holds only its digest (put it in the deployment YAML)."""
    from serve_app.governance.keys import key_digest, new_key

    if args.action == "digest":
        key = sys.stdin.readline().strip()
        if not key:
            print("give the key on standard input", file=sys.stderr)
            return 2
        print(key_digest(key))
        return 0
    key = new_key()
    print(f"API key for {args.tenant} (shown once; the config keeps only its digest):\n  {key}\n")
    print("deployment YAML:\ntenants:")
    print(f"  - name: {args.tenant}\n    api_key_sha256:\n      - {key_digest(key)}")
    return 0


def cmd_vllm(args: argparse.Namespace) -> int:
    from serve_app.engine.vllm_adapter import run_vllm_cli

    return run_vllm_cli(args.vllm_args)


def cmd_haproxy_binary(args: argparse.Namespace) -> int:
    """Write this node's HAProxy wrapper (no kernel splicing) and print its path, for
    ``export RAY_SERVE_HAPROXY_BINARY_PATH=$(serve-app haproxy-binary)`` before ``ray start``."""
    from serve_app.ingress.haproxy import write_wrapper

    print(write_wrapper(Path(args.dir) if args.dir else None))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="serve-app", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="serve a deployment config on a local or existing Ray cluster")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="deployment YAML")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start local)")
    p.add_argument("--port", type=int, default=None, help="override router.port")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("deploy", help="apply a deployment config to a running stack and return "
                       "(tenant changes live, others redeploy)")
    p.add_argument("--config", required=True, help="deployment YAML")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: the local "
                   "cluster's)")
    p.add_argument("--port", type=int, default=None, help="override router.port (as `run`)")
    p.set_defaults(func=cmd_deploy)

    p = sub.add_parser("status", help="the running app: replicas by state, live tenants, each "
                       "engine replica's node and requests")
    p.add_argument("--address", default="auto", help="Ray cluster address")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("usage", help="sum the usage records (one JSON line per request) per "
                       "tenant and model")
    p.add_argument("--file", action="append", default=None, help="a usage file or a folder "
                   "of them (repeatable; default: the config's governance.usage.dir)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="deployment YAML whose "
                   "governance.usage.dir to read when no --file is given")
    p.add_argument("--since", default=None, help="only requests since then: 30m, 24h, 7d or "
                   "an ISO date/time (UTC)")
    p.add_argument("--tenant", default=None, help="only this tenant")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p.set_defaults(func=cmd_usage)

    p = sub.add_parser("make-model", help="write a tiny model or a config-only full-size shape")
    p.add_argument("kind", choices=MODEL_KINDS)
    p.add_argument("--out", default=None, help="folder (default: models/<name>)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("make-adapter", help="write a LoRA adapter (PEFT format, random "
                       "weights, q_proj and v_proj) for a Llama-shaped model")
    p.add_argument("--base", default="models/tiny-llama", help="the model's folder (only its "
                   "config.json is read: the tiny model or a config-only shape)")
    p.add_argument("--out", default="models/tiny-llama-lora", help="folder")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rank", type=int, default=8)
    p.set_defaults(func=cmd_make_adapter)

    given = sys.argv[1:] if argv is None else argv
    for name, (module, _, help_text) in BENCH_COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if given[:1] == [name]:  # only the subcommand that runs imports its tool
            bench_module(module).add_arguments(p)
        p.set_defaults(func=cmd_bench_tool)

    p = sub.add_parser("dashboards", help="write the Grafana dashboards (JSON) to a folder")
    p.add_argument("--out", default="dashboards",
                   help="folder (with --preview: default dashboards/previews)")
    p.add_argument("--preview", metavar="PROMETHEUS_URL", default=None,
                   help="instead: draw each dashboard as a PNG from this Prometheus's data, "
                   "its panels' queries run as Grafana runs them")
    p.add_argument("--range-s", type=float, default=300.0,
                   help="with --preview: the time range drawn, ending now")
    p.add_argument("--push", metavar="GRAFANA_URL", default=None,
                   help="instead: create or update the dashboards on this Grafana server "
                   "(token from $GRAFANA_TOKEN)")
    p.add_argument("--folder-uid", default=None,
                   help="with --push: an existing Grafana folder (default: General)")
    p.set_defaults(func=cmd_dashboards)

    p = sub.add_parser("keys", help="make API keys: `keys new TENANT`, `keys digest < KEYFILE`")
    p.add_argument("action", choices=["new", "digest"])
    p.add_argument("tenant", nargs="?", default="my-team")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("haproxy-binary", help="write this node's HAProxy wrapper (no kernel "
                       "splicing, so client disconnects get through) and print its path")
    p.add_argument("--dir", default=None, help="folder for the wrapper (default: a per-user "
                   "folder under the temp dir)")
    p.set_defaults(func=cmd_haproxy_binary)

    p = sub.add_parser("vllm", help="vLLM's own CLI (serve, bench serve) on either vLLM build")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_vllm)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
