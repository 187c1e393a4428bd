"""Command line client for a nanoserve server.

    python -m client generate "Once upon a time" --max-tokens 64 --temperature 0
    python -m client generate "Why is the sky blue?" --chat --stop $'\\n\\n'
    python -m client --target 10.0.0.5:50051 info
    python -m client health

Generated text goes to stdout as it streams; the finish reason and token usage go to
stderr, so `> out.txt` captures only the text.

Exit codes: 0 ok; 1 a gRPC error, with stderr naming the status code (e.g.
"error: INVALID_ARGUMENT: prompt is empty"); 2 bad command line; 3 `health` answered
but not SERVING. The target defaults to $NANOSERVE_TARGET, else 127.0.0.1:50051.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Sequence

from client.client import DEFAULT_TARGET, Client, GenerationChunk, NanoserveError, SamplingParams

EXIT_RPC_ERROR = 1
EXIT_NOT_SERVING = 3


def _add_connection_args(parser: argparse.ArgumentParser, top_level: bool) -> None:
    """--target/--timeout are accepted before or after the subcommand; only the top-level
    parser holds the defaults, so a subcommand doesn't overwrite a value given earlier."""
    target_default = os.environ.get("NANOSERVE_TARGET", DEFAULT_TARGET) if top_level \
        else argparse.SUPPRESS
    timeout_default = None if top_level else argparse.SUPPRESS
    parser.add_argument("--target", metavar="HOST:PORT", default=target_default,
                        help=f"server address (default: $NANOSERVE_TARGET or {DEFAULT_TARGET}); "
                             "several replicas as HOST:PORT,HOST:PORT are balanced round-robin")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", default=timeout_default,
                        help="deadline for each call (default: none)")
    keep = {} if top_level else {"default": argparse.SUPPRESS}
    parser.add_argument("--api-key", metavar="KEY",
                        **(keep or {"default": os.environ.get("NANOSERVE_API_KEY")}),
                        help="API key sent with every call (default: $NANOSERVE_API_KEY)")
    parser.add_argument("--tls", action="store_true", **keep,
                        help="connect with TLS, trusting the system's root certificates")
    parser.add_argument("--tls-ca", metavar="PEM", **keep,
                        help="connect with TLS, trusting this root certificate")
    parser.add_argument("--tls-cert", metavar="PEM", **keep,
                        help="client certificate, for servers that require one (with --tls-key)")
    parser.add_argument("--tls-key", metavar="PEM", **keep, help="private key of --tls-cert")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m client", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_connection_args(parser, top_level=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate a completion for PROMPT",
                         description="Generate a completion. Unset sampling options take the "
                                     "server's defaults (temperature 1, max 256 tokens).")
    _add_connection_args(gen, top_level=False)
    gen.add_argument("prompt", metavar="PROMPT", help='prompt text ("-" reads stdin)')
    how = gen.add_argument_group("prompt form")
    how.add_argument("--chat", action="store_true",
                     help="send PROMPT as a user message, rendered with the model's chat template")
    how.add_argument("--system", metavar="TEXT", help="with --chat: a system message first")
    how.add_argument("--ids", action="store_true",
                     help="PROMPT is token ids separated by commas or spaces (e.g. '1,2,3')")
    samp = gen.add_argument_group("sampling")
    samp.add_argument("--max-tokens", type=int, metavar="N", help="most tokens to generate")
    samp.add_argument("--temperature", type=float, metavar="T", help="0 = greedy")
    samp.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling, in (0, 1]")
    samp.add_argument("--top-k", type=int, metavar="K", help="keep the K likeliest tokens (0 = off)")
    samp.add_argument("--min-p", type=float, metavar="P",
                      help="drop tokens below P x the top probability")
    samp.add_argument("--seed", type=int, help="make sampling reproducible")
    samp.add_argument("--stop", action="append", default=[], metavar="S",
                      help="stop before this string (repeatable)")
    samp.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                      help="stop after this token id (repeatable)")
    samp.add_argument("--ignore-eos", action="store_true",
                      help="keep generating past the end-of-sequence token")
    samp.add_argument("--skip-special-tokens", action="store_true",
                      help="leave special tokens out of the text")
    fmt = gen.add_argument_group("output format (at most one; the output is constrained to it)")
    fmt.add_argument("--json-schema", metavar="FILE", help="a JSON Schema file")
    fmt.add_argument("--json-object", action="store_true", help="any JSON object")
    fmt.add_argument("--regex", metavar="RE", help="a regex the whole output matches")
    fmt.add_argument("--grammar", metavar="FILE", help="a Lark or GBNF grammar file")
    fmt.add_argument("--choice", action="append", metavar="S",
                     help="one of these strings (repeatable)")
    out = gen.add_argument_group("output")
    out.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                     help="print text as it is generated (default), or all at once")
    out.add_argument("--logprobs", action="store_true",
                     help="ask for token log-probabilities (printed to stderr, or in --json)")
    out.add_argument("--json", action="store_true",
                     help="print JSON instead of text: one object per streamed chunk, or the "
                          "whole completion with --no-stream")

    h = sub.add_parser("health", help="grpc.health.v1 check: prints the status, exit 0 "
                                      "when SERVING, 3 otherwise")
    _add_connection_args(h, top_level=False)
    info = sub.add_parser("info", help="model info and live scheduler stats as JSON")
    _add_connection_args(info, top_level=False)
    tok = sub.add_parser("tokenize", help="print the token ids of PROMPT as JSON")
    _add_connection_args(tok, top_level=False)
    tok.add_argument("prompt", metavar="PROMPT", help='text ("-" reads stdin)')
    tok.add_argument("--chat", action="store_true", help="tokenize PROMPT as a user message")
    emb = sub.add_parser("embed", help="print the embedding of each TEXT as JSON (one list "
                                       "per line; a server with --task embed)")
    _add_connection_args(emb, top_level=False)
    emb.add_argument("texts", nargs="+", metavar="TEXT", help='text to embed ("-" reads stdin)')
    emb.add_argument("--dimensions", type=int, default=0,
                     help="matryoshka: keep the first N values, renormalised (0: all)")
    emb.add_argument("--truncate", action="store_true",
                     help="cut a text longer than the context instead of failing")
    sc = sub.add_parser("score", help="print P(yes) that each DOCUMENT meets QUERY, one per "
                                      "line (a reranker: a server with --task score)")
    _add_connection_args(sc, top_level=False)
    sc.add_argument("query", metavar="QUERY")
    sc.add_argument("documents", nargs="+", metavar="DOCUMENT")
    sc.add_argument("--instruction", default="",
                    help="the reranker's task (default: Qwen3-Reranker's web search one)")
    sc.add_argument("--truncate", action="store_true",
                    help="cut a document that does not fit instead of failing")
    sub.add_parser("bench", add_help=False,
                   help="the benchmark client (python -m client bench --help)")
    return parser


def _prompt(args: argparse.Namespace) -> Any:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if getattr(args, "ids", False):
        try:
            return [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            print(f"error: --ids expects integers, got {text!r}", file=sys.stderr)
            raise SystemExit(2) from None
    if args.chat:
        system = getattr(args, "system", None)
        return ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": text}]
    return text


def _read(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                          stop=args.stop, stop_token_ids=args.stop_token_id,
                          ignore_eos=args.ignore_eos, logprobs=args.logprobs,
                          json_schema=_read(args.json_schema), json_object=args.json_object,
                          regex=args.regex, grammar=_read(args.grammar), choice=args.choice)


def cmd_generate(client: Client, args: argparse.Namespace) -> int:
    start = time.perf_counter()
    ids: list[int] = []
    logprobs: list[float] = []
    last: GenerationChunk | None = None
    for chunk in client.generate(_prompt(args), _params(args), stream=args.stream,
                                 skip_special_tokens=args.skip_special_tokens):
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        last = chunk
        if args.json:
            print(json.dumps(asdict(chunk), ensure_ascii=False), flush=True)
        else:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    if not args.json:
        sys.stdout.write("\n")
    elapsed = time.perf_counter() - start
    usage = last.usage if last and last.usage else None
    line = f"[finish_reason={last.finish_reason if last else None}"
    if usage:
        line += (f" prompt_tokens={usage.prompt_tokens} completion_tokens="
                 f"{usage.completion_tokens} cached_tokens={usage.cached_tokens}")
    line += f" time={elapsed:.2f}s tok/s={len(ids) / elapsed if elapsed > 0 else 0:.1f}]"
    if args.logprobs and not args.json:
        print(json.dumps([{"id": i, "logprob": lp} for i, lp in zip(ids, logprobs)]),
              file=sys.stderr)
    print(line, file=sys.stderr)
    return 0


def cmd_health(client: Client, args: argparse.Namespace) -> int:
    status = client.health()
    print(status)
    return 0 if status == "SERVING" else EXIT_NOT_SERVING


def cmd_info(client: Client, args: argparse.Namespace) -> int:
    info = {"model_info": asdict(client.model_info()), "stats": asdict(client.stats())}
    print(json.dumps(info, indent=2))
    return 0


def cmd_tokenize(client: Client, args: argparse.Namespace) -> int:
    print(json.dumps(client.tokenize(_prompt(args))))
    return 0


def cmd_embed(client: Client, args: argparse.Namespace) -> int:
    texts = [sys.stdin.read() if t == "-" else t for t in args.texts]
    for vec in client.embed(texts, dimensions=args.dimensions, truncate=args.truncate):
        print(json.dumps(vec))
    return 0


def cmd_score(client: Client, args: argparse.Namespace) -> int:
    for s in client.score(args.query, args.documents, instruction=args.instruction,
                          truncate=args.truncate):
        print(f"{s:.6f}")
    return 0


COMMANDS = {"generate": cmd_generate, "health": cmd_health, "info": cmd_info,
            "tokenize": cmd_tokenize, "embed": cmd_embed, "score": cmd_score}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:   # its own flags (client/bench.py)
        from client.bench import main as bench_main
        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    formats = [f for f in ("json_schema", "json_object", "regex", "grammar", "choice")
               if getattr(args, f, None)]
    if len(formats) > 1:
        parser.error(f"give one output format, not {' and '.join(formats)}")
    try:
        with Client(args.target, timeout=args.timeout, api_key=args.api_key, tls=args.tls,
                    tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key) as client:
            return COMMANDS[args.command](client, args)
    except NanoserveError as e:
        sys.stdout.flush()
        print(f"error: {e.code.name}: {e.message}", file=sys.stderr)
        return EXIT_RPC_ERROR
    except KeyboardInterrupt:  # leaving the stream cancels the request on the server
        return 130


if __name__ == "__main__":
    sys.exit(main())
