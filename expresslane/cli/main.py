"""`expresslane` command line: make-model, quantize, generate, serve, batch, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from expresslane import __version__
from expresslane.batch_api.cli import add_batch_parser
from expresslane.bench.cli import add_bench_parser
from expresslane.config import add_cli_args, engine_kwargs_from_args
from expresslane.config.commands import (
    GenerateConfig,
    LoggingConfig,
    MakeModelConfig,
    QuantizeConfig,
)
from expresslane.config.flags import add_args, from_args
from expresslane.router.cli import add_router_parser
from expresslane.server.cli import add_serve_parser


def _make_model(args: argparse.Namespace) -> int:
    from expresslane.models.presets import make_model

    cfg = from_args(MakeModelConfig, args)
    path = make_model(args.preset, args.dir, seed=cfg.seed, device=cfg.device, quantization=cfg.quantization,
                      weights=not cfg.no_weights)
    quant = f", {cfg.quantization}" if cfg.quantization else ""
    print(f"wrote {args.preset} (seed {cfg.seed}{quant}) to {path}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from expresslane.models.quantize import quantize_dir

    fmt = from_args(QuantizeConfig, args).quantization
    print(f"wrote {args.model} quantized to {fmt} to {quantize_dir(args.model, args.dir, fmt)}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from expresslane import LLM, SamplingParams

    g = from_args(GenerateConfig, args)
    params = SamplingParams(max_tokens=g.max_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                            min_p=g.min_p, seed=g.sampling_seed, stop=list(g.stop), ignore_eos=g.ignore_eos, n=g.n)
    llm = LLM(**engine_kwargs_from_args(args))  # includes the positional model
    prompt = g.prompt
    if g.chat:
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
    add_args(parser, LoggingConfig)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    # Positionals are hand-written (they are not knobs); every flag comes from the config tree.
    p = sub.add_parser("make-model", help="write a model directory with random weights at a real architecture's shapes")
    p.add_argument("preset", help="tiny, qwen2.5-0.5b, llama-3.2-1b, llama-3-8b, qwen2.5-7b, mistral-7b, "
                   "mistral-7b-v0.1, mixtral-8x7b, qwen3-30b-a3b, phi-3.5-mini, phi-4, gemma-2-9b, gemma-3-12b, "
                   "gpt-oss-20b, deepseek-v2-lite or deepseek-v3")
    p.add_argument("dir", help="output directory")
    add_args(p, MakeModelConfig)
    p.set_defaults(func=_make_model)

    p = sub.add_parser("quantize", help="copy a model directory with its decoder layers' weights quantized "
                       "(round to nearest, in the fp8, awq or gptq checkpoint format)")
    p.add_argument("model", help="model directory (unquantized safetensors)")
    p.add_argument("dir", help="output directory (must not exist)")
    add_args(p, QuantizeConfig)
    p.set_defaults(func=_quantize)

    p = sub.add_parser("generate", help="complete one prompt offline")
    p.add_argument("model", nargs="?", default=None, help="model directory (default: the built-in stdlib-llama-9m)")
    add_args(p, GenerateConfig)
    add_cli_args(p)
    p.set_defaults(func=_generate)

    add_serve_parser(sub)  # these import no server or plotting libraries until they run
    add_router_parser(sub)
    add_batch_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=from_args(LoggingConfig, args).log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
