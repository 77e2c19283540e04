"""One llama.cpp server replica in its own process, from the xllamacpp wheel.

Run as ``python -m extproc.stack.xllamacpp_server --model M --port P ...``. The flags are
named as llama-server's, so the launcher builds one command line for both backends.
xllamacpp serves llama.cpp's own HTTP API (/health, /v1/chat/completions, /slots,
/metrics, timings) from a thread of this process; the main thread only waits. SIGTERM
ends the process at once (Python's default action): a replica has no state worth saving.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True, help="GGUF file")
    parser.add_argument("-a", "--alias", default="", help="the model's served name (answers' model, /v1/models)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("-c", "--ctx-size", type=int, required=True, help="total context, shared by the slots")
    parser.add_argument("-np", "--parallel", type=int, required=True, help="slots (concurrent sequences)")
    parser.add_argument("-t", "--threads", type=int, required=True)
    parser.add_argument("-b", "--batch-size", type=int, default=2048, help="prompt tokens a step of the server loop "
                                                                          "takes (llama.cpp's default 2048)")
    parser.add_argument("-ub", "--ubatch-size", type=int, default=512, help="tokens of one compute pass (512)")
    parser.add_argument("--cache-ram", type=int, required=True, help="host-RAM prompt cache, MiB (0 = off)")
    parser.add_argument("--slot-prompt-similarity", type=float, default=0.1,
                        help="a new prompt takes the idle slot sharing more than this share of it")
    parser.add_argument("--slot-save-path", default="", help="enables /slots actions (erase) when set")
    parser.add_argument("--api-key-file", default="", help="each line a key: every request but /health must "
                                                            "carry one (authorization: Bearer KEY)")
    parser.add_argument("--metrics", action="store_true", help="serve Prometheus /metrics")
    parser.add_argument("--sleep-idle-seconds", type=int, default=-1, help="unload the model and its cache after "
                                                                          "this many idle seconds (-1: never)")
    parser.add_argument("--lora-scaled", action="append", default=[], type=scaled_adapter, metavar="FILE:SCALE",
                        help="a LoRA adapter to load, applied at SCALE to requests without \"lora\" (repeatable; "
                             "a request's \"lora\" names it by its index, from 0 in order)")
    return parser


def api_keys(path: str) -> list[str]:
    """The keys in an --api-key-file, read as llama-server reads it (one a line, blank lines skipped)."""
    if not path:
        return []
    with open(path) as file:
        return [line.rstrip("\n") for line in file if line.rstrip("\n")]


def scaled_adapter(value: str) -> tuple[str, float]:
    """``FILE:SCALE``, as llama-server's --lora-scaled reads one."""
    path, colon, scale = value.rpartition(":")
    if not colon or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected FILE:SCALE")
    return path, float(scale)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    if args.alias:
        params.model_alias = {args.alias}
    params.hostnames = [args.host]
    params.port = args.port
    params.n_ctx = args.ctx_size
    params.n_parallel = args.parallel
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.n_batch = args.batch_size
    params.n_ubatch = args.ubatch_size
    params.cache_ram_mib = args.cache_ram
    params.slot_prompt_similarity = args.slot_prompt_similarity
    # llama-server ends the folder with a separator; xllamacpp joins it to a file name as given
    params.slot_save_path = os.path.join(args.slot_save_path, "") if args.slot_save_path else ""
    params.endpoint_slots = True
    params.endpoint_metrics = args.metrics
    params.api_keys = api_keys(args.api_key_file)
    params.sleep_idle_seconds = args.sleep_idle_seconds
    params.lora_adapters = [xllamacpp.CommonAdapterLoraInfo(path, scale) for path, scale in args.lora_scaled]
    server = xllamacpp.Server(params)  # returns once the model is loaded and the port listens
    print(f"llm-ring replica listening on {server.listening_address}", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
