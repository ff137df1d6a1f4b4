"""`supernode serve --stack S --local`: the serving backend's OpenAI-compatible server (vLLM,
supernode.core.serving) on this machine, for the exported model, after verifying every file's sha256
against the export's manifest (a mismatch: exit 2 naming the file; the server never starts). With
--prompt it answers those prompts, prints each completion with its latency and stops; without, it
serves until Ctrl-C; a completion that is only whitespace is printed as such. vLLM runs from the
serving environment (`supernode serve-env`; where it is looked for: supernode.tools.serve.serve_python).
In the cluster the stack's serving workload does the same (components/k8s/serving.py)."""

from __future__ import annotations

import math
import signal
from pathlib import Path

from ...core.errors import EXIT_FAILED, BadInput
from ..args import add_stack_args, stack_from_args


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the exported model locally (weights verified first)")
    add_stack_args(p)
    p.add_argument("--local", action="store_true", help="run on this machine (the cluster serves through the stack)")
    # required, as `supernode export --out` is: there is no default place an export lands
    p.add_argument("--model", type=Path, required=True, help="the exported model directory (supernode export --out)")
    p.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (0: any free port)")
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="complete this prompt, print it with its latency, stop (repeatable)",
    )
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per completion (default 48)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (default 1)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for repeatable sampled completions")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the server (default 300)")
    p.add_argument(
        "--tls",
        action="store_true",
        help="serve over HTTPS with a self-signed certificate made for this server, and require an API key "
        "(printed; as the cluster's server does)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.local:
        raise BadInput(
            "cluster serving is the stack's serving workload (pulumi up deploys it from the inference "
            "section); use --local to serve on this machine"
        )
    if not 0 <= args.port < 65536:
        raise BadInput(f"--port must be between 0 and 65535 (got {args.port})")
    if not 0 < args.ready_timeout < math.inf:
        raise BadInput(f"--ready-timeout must be a finite number of seconds above 0 (got {args.ready_timeout})")
    if args.max_tokens < 1:
        raise BadInput(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    _, cfg = stack_from_args(args)
    from ...tools.serve import LocalServer, Sampling, ServerFailed, complete, serve_python, shown_text, verify_export

    sampling = Sampling(args.temperature, args.top_p, args.seed)  # bad values: exit 2 before anything starts

    model = args.model
    manifest = verify_export(model)  # before anything starts: a changed file is bad input
    print(
        f"verified {len(manifest['files'])} files of {model} against manifest.json (sha256); "
        f"{manifest['architecture']}, {manifest['dtype']}"
    )
    inf = cfg.inference
    server = LocalServer(
        model.resolve(),
        serve_python(args.root),
        port=args.port,
        ready_timeout_s=args.ready_timeout,
        max_num_seqs=min(inf.max_concurrency, 16) if inf else 16,
        tls=args.tls,
    )
    # SIGTERM as Ctrl-C, from before the server starts: either way the finally below stops its session.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.start()
        print(f"serving {manifest['architecture']} at {server.url}/v1 (log {server.log})", flush=True)
        if server.tls:
            print(
                f"API key (Authorization: Bearer ...): {server.api_key}\nthe server's CA:\n{server.ca_pem}", flush=True
            )
        if not args.prompt:
            print("Ctrl-C stops it", flush=True)
            rc = server.proc.wait()
            print(f"the server exited ({rc}):\n{server.tail()}")
            return EXIT_FAILED
        for prompt in args.prompt:
            c = complete(server.url, prompt, args.max_tokens, model=server.name, sampling=sampling)
            print(f"\n>>> {prompt}{shown_text(c.text)}")
            print(
                f"    {c.tokens} tokens: first token {c.ttft_s * 1e3:.0f} ms, total {c.total_s * 1e3:.0f} ms, "
                f"inter-token {c.itl_s * 1e3:.1f} ms, "
                f"{c.tokens / c.total_s:.1f} tokens/s"
            )
        return 0
    except ServerFailed as e:
        print(f"serving failed: {e}")
        return EXIT_FAILED
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
