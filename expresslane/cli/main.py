"""`expresslane` command line: make-model, generate, serve, batch, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from expresslane import __version__
from expresslane.batch.cli import add_batch_parser
from expresslane.bench.cli import add_bench_parser
from expresslane.config import add_cli_args, engine_kwargs_from_args
from expresslane.router.cli import add_router_parser
from expresslane.server.cli import add_serve_parser


def _make_model(args: argparse.Namespace) -> int:
    from expresslane.models.presets import make_model

    path = make_model(args.preset, args.dir, seed=args.seed, device=args.device, quantization=args.quantization,
                      weights=not args.no_weights)
    quant = f", {args.quantization}" if args.quantization else ""
    print(f"wrote {args.preset} (seed {args.seed}{quant}) to {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from expresslane import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop,
                            ignore_eos=args.ignore_eos, n=args.n)
    llm = LLM(**engine_kwargs_from_args(args))  # includes the positional model
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    for comp in out.outputs:
        if len(out.outputs) > 1:
            print(f"--- completion {comp.index} ({comp.finish_reason})")
        print(comp.text)
    m = out.metrics
    print(f"[{sum(len(c.token_ids) for c in out.outputs)} tokens, ttft {1000 * (m.first_token_time - m.arrival_time):.1f} ms, "
          f"total {1000 * (m.finished_time - m.arrival_time):.1f} ms]", file=sys.stderr)
    return 0


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, unless it has none worth saying (None,
    False, suppressed) or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or default == []
                or "default" in text or not (action.option_strings or action.nargs == "?")):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


class Parser(argparse.ArgumentParser):
    """Every (sub)command's parser shows defaults in its help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="expresslane", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("make-model", help="write a model directory with random weights at a real architecture's shapes")
    p.add_argument("preset", help="tiny, qwen2.5-0.5b, llama-3.2-1b, llama-3-8b, qwen2.5-7b, mistral-7b, "
                   "mixtral-8x7b or qwen3-30b-a3b")
    p.add_argument("dir", help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where to generate the weights (cuda is much faster)")
    p.add_argument("--quantization", choices=("fp8", "awq", "gptq"), default=None,
                   help="write the decoder layers' weights quantized: fp8 (compressed-tensors, per-channel "
                        "e4m3), awq or gptq (4-bit, group size 128)")
    p.add_argument("--no-weights", action="store_true",
                   help="write the config and tokenizer only; serve it with --load-format dummy (the engine "
                        "generates the same weights on its device)")
    p.set_defaults(func=_make_model)

    p = sub.add_parser("generate", help="complete one prompt offline")
    p.add_argument("model", nargs="?", default=None, help="model directory (default: the built-in tiny model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampler")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("-n", type=int, default=1, help="number of completions")
    add_cli_args(p)
    p.set_defaults(func=_generate)

    add_serve_parser(sub)  # these import no server or plotting libraries until they run
    add_router_parser(sub)
    add_batch_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
