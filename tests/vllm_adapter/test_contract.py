"""The static vLLM contract (scripts/vllm_contract.py): the installed vLLM meets it, a wrong
name or a removed method fails it and is named, moved symbols pass at either location, and
the declared overrides are the adapter's own. Nothing here imports vLLM."""

from __future__ import annotations

import ast
import dataclasses
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import ROOT
from tests.helpers import load_script

ADAPTER = ROOT / "pte_instrument" / "vllm_adapter"
SCHED = "vllm/v1/core/sched"


@pytest.fixture(scope="module")
def contract() -> ModuleType:
    return load_script(ROOT / "scripts" / "vllm_contract.py")


def item(contract: ModuleType, where: str):
    return next(i for i in contract.CONTRACT if where in i.where)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """A vLLM tree holding ``files`` (relative paths), every package with its __init__.py."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        for parent in path.relative_to(root).parents:
            if parent != Path("."):
                (root / parent / "__init__.py").touch()
    return root


def scheduler_tree(contract: ModuleType, root: Path, rename: str | None = None) -> Path:
    """The installed scheduler files; ``rename``: that method renamed in scheduler.py."""
    installed = contract.installed_vllm()
    files = {
        f"{SCHED}/{name}": (installed / "v1/core/sched" / name).read_text(encoding="utf-8")
        for name in ("scheduler.py", "async_scheduler.py", "output.py")
    }
    if rename is not None:
        source = files[f"{SCHED}/scheduler.py"]
        assert f"def {rename}(" in source
        files[f"{SCHED}/scheduler.py"] = source.replace(f"def {rename}(", f"def {rename}_gone(")
    return write_tree(root, files)


def test_the_installed_vllm_meets_the_contract(contract):
    with contract.open_tree(contract.installed_vllm()) as tree:
        results = contract.check(tree)
    assert [r.line() for r in results if not r.ok] == []
    assert len(results) == len(contract.CONTRACT) > 20


def test_a_wrong_name_in_the_list_fails_and_is_named(contract):
    stats = item(contract, "vllm.v1.metrics.stats:FinishedRequestStats")
    base = item(contract, "vllm.v1.metrics.loggers:AggregateStatLoggerBase")
    wrong = [
        dataclasses.replace(stats, fields=(*stats.fields, "num_cached_tokenz")),
        dataclasses.replace(base, methods=("record(scheduler_stats, iteration_stats, engine_index)",)),
        contract.Item(("vllm.v1.request:Requestz",), "class", "test"),
    ]
    with contract.open_tree(contract.installed_vllm()) as tree:
        results = contract.check(tree, wrong)
    assert [r.ok for r in results] == [False, False, False]
    assert results[0].problems == ("field num_cached_tokenz",)  # the other fields are there
    assert results[1].problems == (
        "method record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx), "
        "expected record(scheduler_stats, iteration_stats, engine_index)",
    )
    assert results[2].problems == ("not found",)
    assert "missing  vllm.v1.request:Requestz: not found" in results[2].line()


def test_a_method_removed_from_a_tree_fails_and_is_named(contract, tmp_path, capsys):
    intact = scheduler_tree(contract, tmp_path / "intact")
    broken = scheduler_tree(contract, tmp_path / "broken", rename="_free_request")
    items = [
        item(contract, f"vllm.v1.core.sched.{m}")
        for m in ("scheduler:Scheduler", "async_scheduler:AsyncScheduler")
    ]
    with contract.open_tree(intact) as tree:
        assert all(r.ok for r in contract.check(tree, items))
    with contract.open_tree(broken / "vllm") as tree:  # the package dir itself works too
        results = contract.check(tree, items)
    # AsyncScheduler inherits it: the base class is followed into scheduler.py
    assert [r.problems for r in results] == [("method _free_request",)] * 2

    assert contract.main([str(broken)]) == 1
    out = capsys.readouterr().out
    assert "missing  vllm.v1.core.sched.scheduler:Scheduler: method _free_request" in out
    assert "ok       vllm.v1.core.sched.output:SchedulerOutput" in out


def test_a_wheel_is_read_like_its_directory(contract, tmp_path):
    tree_dir = scheduler_tree(contract, tmp_path / "tree", rename="update_from_output")
    wheel = tmp_path / "vllm-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in sorted(tree_dir.rglob("*.py")):
            zf.write(path, path.relative_to(tree_dir).as_posix())
    with contract.open_tree(tree_dir) as a, contract.open_tree(wheel) as b:
        from_dir, from_wheel = contract.check(a), contract.check(b)
    assert [r.problems for r in from_dir] == [r.problems for r in from_wheel]
    assert item(contract, "vllm.v1.core.sched.scheduler:Scheduler") in [
        r.item for r in from_wheel if not r.ok
    ]


def test_a_moved_symbol_passes_at_either_location(contract, tmp_path):
    setup = item(contract, "vllm.entrypoints.common.startup:cli_env_setup")
    new = write_tree(
        tmp_path / "new", {"vllm/entrypoints/common/startup.py": "def cli_env_setup():\n    pass\n"}
    )
    old = write_tree(
        tmp_path / "old", {"vllm/entrypoints/serve/utils/api_utils.py": "def cli_env_setup():\n    pass\n"}
    )
    # a re-export counts: `from .startup import cli_env_setup as cli_env_setup`
    reexport = write_tree(
        tmp_path / "reexport",
        {
            "vllm/entrypoints/common/impl.py": "def cli_env_setup():\n    pass\n",
            "vllm/entrypoints/common/startup.py": "from .impl import cli_env_setup as cli_env_setup\n",
        },
    )
    neither = write_tree(tmp_path / "neither", {"vllm/entrypoints/common/startup.py": "X = 1\n"})
    matched = {}
    for name, root in (("new", new), ("old", old), ("reexport", reexport), ("neither", neither)):
        with contract.open_tree(root) as tree:
            matched[name] = contract.check_item(tree, setup)
    assert matched["new"].matched == matched["reexport"].matched == setup.where[0]
    assert matched["old"].matched == setup.where[1]
    assert not matched["neither"].ok
    assert matched["neither"].problems == tuple(
        f"{w}: {p}"
        for w, p in zip(
            setup.where, ("not found", "no module vllm.entrypoints.serve.utils.api_utils"), strict=True
        )
    )


def test_a_path_without_vllm_is_bad_input(contract, tmp_path, capsys):
    assert contract.main([str(tmp_path)]) == 2
    assert "neither a .whl nor a directory holding the vllm package" in capsys.readouterr().err


# --- the declared list is the adapter's ------------------------------------------------------


def adapter_class(module: str, name: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse((ADAPTER / f"{module}.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


@pytest.mark.parametrize(
    ("module", "cls", "where", "own"),
    [
        # the hook's __init__ passes everything through; its _pte* helpers are its own
        (
            "scheduler",
            "_PteHook",
            "vllm.v1.core.sched.scheduler:Scheduler",
            lambda n: n.startswith("_pte") or n in ("__init__", "__init_subclass__"),
        ),
        (
            "stat_logger",
            "PteStatLogger",
            "vllm.v1.metrics.loggers:AggregateStatLoggerBase",
            lambda n: n == "_converted",
        ),
        (
            "endpoints",
            "PteEndpoints",
            "vllm.plugins.endpoint_plugins.interface:EndpointPlugin",
            lambda n: False,
        ),
    ],
)
def test_the_declared_methods_are_the_adapters_overrides(contract, module, cls, where, own):
    """Every vLLM method the adapter overrides is declared, with the parameters it takes."""
    declared = {contract.parse_signature(spec)[0]: spec for spec in item(contract, where).methods}
    overrides = {name: node for name, node in adapter_class(module, cls).items() if not own(name)}
    assert set(overrides) == set(declared)
    for name, node in overrides.items():
        _, params, open_ended = contract.parse_signature(declared[name])
        actual = contract.parameters(node, method=True)
        if open_ended:  # the override forwards what it does not name
            assert actual[: len(params)] == params and "*args" in actual and "**kwargs" in actual, name
        else:
            assert actual == params, name


def test_the_async_scheduler_item_declares_what_the_scheduler_item_does(contract):
    sync = item(contract, "vllm.v1.core.sched.scheduler:Scheduler")
    asynchronous = item(contract, "vllm.v1.core.sched.async_scheduler:AsyncScheduler")
    assert (sync.methods, sync.fields) == (asynchronous.methods, asynchronous.fields)


def test_the_middleware_asks_for_the_api_key_where_vllm_does():
    from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX

    from pte_instrument.server.middleware import API_KEY_PREFIXES

    assert API_KEY_PREFIXES == GUARDED_PREFIX
