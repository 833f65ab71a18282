"""Check a vLLM release against every vLLM symbol and signature the adapter
(``pte_instrument/vllm_adapter/``) relies on, without importing vLLM: the files are parsed
with ``ast``, so a wheel that cannot be installed here (the GPU build) is checked as well as
the installed package.

    python scripts/vllm_contract.py                     # the installed vllm
    python scripts/vllm_contract.py PATH [PATH ...]     # a vllm package dir, a dir holding one, or a .whl
    python scripts/vllm_contract.py --installed PATH    # both

Prints one line per item, ``ok`` or ``missing`` with what is missing, and exits 1 when
anything is missing, 2 when a path holds no vLLM package. An item with several locations
(a symbol that moved between releases) passes when one of them satisfies it.

Methods are written ``name(p1, p2)``: the parameters after ``self``, exactly (the adapter's
override takes these and vLLM calls it with these names), or ``name(p1, ...)``: these first,
anything after (the override passes the rest through with ``*args, **kwargs``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import sys
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_DEPTH = 12  # re-exports and base classes followed
NO_VALUE = object()


@dataclass(frozen=True)
class Item:
    """One thing the adapter uses. ``where``: ``module:Name`` (or a module, for kind
    ``module``), in the order tried."""

    where: tuple[str, ...]
    kind: str  # "module", "class", "function", "attribute"
    used_by: str
    methods: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    signature: str | None = None  # a function's parameters, as for methods: "(args)"
    value: object = NO_VALUE  # an attribute's literal value

    @property
    def label(self) -> str:
        return " | ".join(self.where)


CONTRACT: tuple[Item, ...] = (
    # Plugin discovery: the entry-point groups in pyproject.toml and the VLLM_PLUGINS allow-list.
    Item(
        ("vllm.plugins:DEFAULT_PLUGINS_GROUP",), "attribute", "pyproject.toml", value="vllm.general_plugins"
    ),
    Item(
        ("vllm.plugins:STAT_LOGGER_PLUGINS_GROUP",),
        "attribute",
        "pyproject.toml",
        value="vllm.stat_logger_plugins",
    ),
    Item(
        ("vllm.plugins:ENDPOINT_PLUGINS_GROUP",), "attribute", "pyproject.toml", value="vllm.endpoint_plugins"
    ),
    Item(("vllm.plugins:load_plugins_by_group",), "function", "plugin loading", signature="(group)"),
    Item(("vllm.plugins:load_general_plugins",), "function", "plugin.py", signature="()"),
    Item(("vllm.plugins:load_endpoint_plugins",), "function", "endpoints.py", signature="(supported_tasks)"),
    Item(
        ("vllm.v1.metrics.loggers:load_stat_logger_plugin_factories",),
        "function",
        "stat_logger.py",
        signature="()",
    ),
    Item(("vllm.envs:VLLM_PLUGINS",), "attribute", "README (VLLM_PLUGINS)"),
    Item(
        ("vllm.plugins.endpoint_plugins.interface:EndpointPlugin",),
        "class",
        "endpoints.py PteEndpoints",
        methods=("attach_router(app)", "init_state(engine_client, state, args)"),
        fields=("name", "required_tasks"),
    ),
    # Stat logger (API server).
    Item(
        ("vllm.v1.metrics.loggers:AggregateStatLoggerBase",),
        "class",
        "stat_logger.py PteStatLogger",
        methods=(
            "__init__(vllm_config, engine_indexes)",
            "record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)",
            "log_engine_initialized()",
        ),
    ),
    Item(
        ("vllm.v1.metrics.stats:FinishedRequestStats",),
        "class",
        "stat_logger.py finished_request",
        fields=(
            "request_id",
            "e2e_latency",
            "num_prompt_tokens",
            "num_cached_tokens",
            "num_generation_tokens",
            "finish_reason",
            "num_preemptions",
            "queued_time",
            "prefill_time",
            "decode_time",
            "inference_time",
            "mean_time_per_output_token",
        ),
    ),
    Item(
        ("vllm.v1.metrics.stats:IterationStats",),
        "class",
        "stat_logger.py record",
        fields=("finished_requests", "iteration_timestamp"),
    ),
    Item(("vllm.v1.metrics.stats:SchedulerStats",), "class", "stat_logger.py"),
    # Configuration reads (compat.py, both processes).
    Item(
        ("vllm.config:VllmConfig",),
        "class",
        "compat.py",
        fields=("model_config", "cache_config", "parallel_config", "scheduler_config", "lora_config"),
    ),
    Item(
        ("vllm.config:ModelConfig",),
        "class",
        "compat.py",
        fields=("served_model_name", "model", "hf_text_config", "dtype"),
    ),
    Item(("vllm.config:CacheConfig",), "class", "compat.py", fields=("cache_dtype", "block_size")),
    Item(
        ("vllm.config:ParallelConfig",),
        "class",
        "compat.py",
        fields=(
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_rank",
            "data_parallel_index",
            "_api_process_rank",
            "_api_process_count",
            "data_parallel_master_ip",
            "data_parallel_rpc_port",
        ),
    ),
    Item(
        ("vllm.config:SchedulerConfig",),
        "class",
        "--scheduler-cls, compat.py async_scheduling",
        fields=("scheduler_cls", "async_scheduling"),
    ),
    # Scheduler hook (engine core).
    *(
        Item(
            (where,),
            "class",
            "scheduler.py _PteHook",
            methods=(
                "schedule(throttle_prefills)",
                "update_from_output(scheduler_output, model_runner_output)",
                "finish_requests(...)",
                "_free_request(request, ...)",
                "shutdown()",
            ),
            fields=("requests", "vllm_config"),
        )
        for where in (
            "vllm.v1.core.sched.scheduler:Scheduler",
            "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
        )
    ),
    # What the hook calls (not overrides), and the driver of tests and benchmarks.
    *(
        Item(
            (where,),
            "class",
            "scheduler.py _PteHook (calls), driver.py",
            methods=(
                "get_num_unfinished_requests()",
                "has_requests()",
                "add_request(request)",
                "update_draft_token_ids(draft_token_ids)",
            ),
            fields=("num_spec_tokens",),
        )
        for where in (
            "vllm.v1.core.sched.scheduler:Scheduler",
            "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
        )
    ),
    Item(
        ("vllm.v1.core.sched.output:SchedulerOutput",),
        "class",
        "scheduler.py _completed_steps",
        fields=(
            "num_scheduled_tokens",
            "scheduled_spec_decode_tokens",
            "scheduled_new_reqs",
            "scheduled_cached_reqs",
        ),
    ),
    Item(
        ("vllm.v1.outputs:ModelRunnerOutput",),
        "class",
        "scheduler.py _pte_drafts (the drafts the model rejected)",
        fields=("req_id_to_index", "sampled_token_ids"),
    ),
    Item(
        ("vllm.v1.core.sched.output:NewRequestData",),
        "class",
        "scheduler.py _completed_steps, compat.py prompt_length",
        fields=("req_id", "num_computed_tokens", "prompt_token_ids", "prompt_embeds"),
    ),
    Item(
        ("vllm.v1.core.sched.output:CachedRequestData",),
        "class",
        "scheduler.py _completed_steps",
        fields=("req_ids", "num_computed_tokens"),
    ),
    Item(
        ("vllm.v1.request:Request",),
        "class",
        "scheduler.py, compat.py finished_counts",
        methods=("get_finished_reason()",),
        fields=(
            "request_id",
            "num_computed_tokens",
            "num_prompt_tokens",
            "num_output_tokens",
            "num_preemptions",
            "client_index",
            "arrival_time",
        ),
    ),
    # LoRA adapters: the ones the API server serves, by name (app.state.openai_serving_models).
    Item(
        ("vllm.entrypoints.openai.models.serving:OpenAIServingModels",),
        "class",
        "compat.py served_lora_adapters",
        fields=("lora_requests",),
    ),
    # The serve launcher and the CPU build's API-server module.
    Item(
        ("vllm.entrypoints.cli.serve:ServeSubcommand",),
        "class",
        "serve.py",
        methods=("subparser_init(subparsers)", "validate(args)", "cmd(args)"),
    ),
    Item(("vllm.logger:configure_logging_from_args",), "function", "serve.py", signature="(args)"),
    Item(("vllm.utils.argparse_utils:FlexibleArgumentParser",), "class", "serve.py"),
    Item(
        (
            "vllm.entrypoints.common.startup:cli_env_setup",
            "vllm.entrypoints.serve.utils.api_utils:cli_env_setup",
        ),
        "function",
        "compat.py cli_env_setup",
        signature="()",
    ),
    Item(("vllm.entrypoints.openai.api_server",), "module", "devtools/serving.py (CPU build)"),
    # --middleware: the session middleware without the endpoint plugin (README).
    Item(
        (
            "vllm.entrypoints.common.cli_args:FrontendArgs",
            "vllm.entrypoints.launchers.cli_args:FrontendArgs",
        ),
        "class",
        "README (--middleware, --api-key, --enable-prompt-tokens-details)",
        fields=("middleware", "api_key", "enable_prompt_tokens_details"),
    ),
    Item(
        ("vllm.entrypoints.serve.middleware.register:init_entrypoints_middleware",),
        "function",
        "README (--middleware)",
        signature="(args, app, ...)",
    ),
)


# --- reading a tree ------------------------------------------------------------------------


class Tree:
    """The Python files of a vLLM package, by module name, parsed on demand."""

    def __init__(self, label: str, read: Callable[[str], str | None]) -> None:
        self.label = label
        self._read = read
        self._parsed: dict[str, ast.Module | None] = {}

    def _file(self, module: str) -> tuple[str, ast.Module] | None:
        base = module.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if rel not in self._parsed:
                text = self._read(rel)
                self._parsed[rel] = None if text is None else ast.parse(text, rel)
            if self._parsed[rel] is not None:
                return rel, self._parsed[rel]
        return None

    def module(self, module: str) -> ast.Module | None:
        found = self._file(module)
        return None if found is None else found[1]

    def is_package(self, module: str) -> bool:
        found = self._file(module)
        return found is not None and found[0].endswith("/__init__.py")

    def version(self) -> str | None:
        tree = self.module("vllm._version")
        for node in [] if tree is None else tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
            ):
                with contextlib.suppress(ValueError):
                    return str(ast.literal_eval(node.value))
        return None


def package_root(path: Path) -> Path | None:
    """The directory holding the ``vllm`` package: given the package itself or its parent."""
    if (path / "__init__.py").is_file() and path.name == "vllm":
        return path.parent
    if (path / "vllm" / "__init__.py").is_file():
        return path
    return None


@contextlib.contextmanager
def open_tree(path: Path) -> Iterator[Tree]:
    """A vLLM tree from a package directory (or one holding it) or a wheel."""
    if path.is_file() and path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            names = set(wheel.namelist())
            if "vllm/__init__.py" not in names:
                raise ValueError(f"{path}: no vllm package in this wheel")

            def read_member(rel: str) -> str | None:
                return wheel.read(rel).decode("utf-8") if rel in names else None

            yield Tree(str(path), read_member)
        return
    root = package_root(path) if path.is_dir() else None
    if root is None:
        raise ValueError(f"{path}: neither a .whl nor a directory holding the vllm package")

    def read_file(rel: str) -> str | None:
        file = root / rel
        return file.read_text(encoding="utf-8") if file.is_file() else None

    yield Tree(str(root / "vllm"), read_file)


def installed_vllm() -> Path:
    """The installed vllm package directory, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("no vllm package is installed in this Python")
    return Path(next(iter(spec.submodule_search_locations)))


# --- resolving names -----------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    kind: str  # "module", "class", "function", "attribute"
    module: str
    node: ast.AST | None


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, including those under ``if``/``try``/``with`` (alternatives,
    ``TYPE_CHECKING`` declarations)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try | getattr(ast, "TryStar", ast.Try)):
            handlers = [stmt for h in node.handlers for stmt in h.body]
            yield from _top_level(node.body + handlers + node.orelse + node.finalbody)
        elif isinstance(node, ast.With):
            yield from _top_level(node.body)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def bindings(tree: Tree, module: str) -> dict[str, list[tuple[str, object]]]:
    """Every module-level name: ``(kind, what)`` for each statement that binds it, in order;
    kinds ``class``/``function``/``attribute`` (what: the node), ``from`` (what: (module,
    name)), ``import`` (what: a module name)."""
    parsed = tree.module(module)
    out: dict[str, list[tuple[str, object]]] = {}
    if parsed is None:
        return out
    package = tree.is_package(module)
    for node in _top_level(parsed.body):
        if isinstance(node, ast.ClassDef):
            out.setdefault(node.name, []).append(("class", node))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out.setdefault(node.name, []).append(("function", node))
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out.setdefault(target.id, []).append(("attribute", node.value))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.setdefault(node.target.id, []).append(("attribute", node.value))
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, package, node)
            for alias in node.names:
                out.setdefault(alias.asname or alias.name, []).append(("from", (source, alias.name)))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.partition(".")[0]
                out.setdefault(bound, []).append(("import", alias.name if alias.asname else bound))
    return out


def lookup(tree: Tree, module: str, name: str, depth: int = 0) -> Found | None:
    """What ``module.name`` is, following re-exports (``from x import name``)."""
    if depth > MAX_DEPTH:
        return None
    for kind, what in bindings(tree, module).get(name, []):
        if kind in ("class", "function", "attribute"):
            return Found(kind, module, what)  # type: ignore[arg-type]
        if kind == "from":
            source, original = what  # type: ignore[misc]
            found = lookup(tree, source, original, depth + 1)
            if found is None and tree.module(f"{source}.{original}") is not None:
                found = Found("module", f"{source}.{original}", None)
            if found is not None:
                return found
        elif kind == "import" and tree.module(str(what)) is not None:
            return Found("module", str(what), None)
    if tree.module(f"{module}.{name}") is not None:  # a submodule
        return Found("module", f"{module}.{name}", None)
    return None


def resolve_expr(tree: Tree, module: str, expr: ast.expr, depth: int) -> Found | None:
    """A base-class expression (``Name``, ``pkg.mod.Name``, ``Generic[T]``) to what it names."""
    if isinstance(expr, ast.Subscript):
        return resolve_expr(tree, module, expr.value, depth)
    if isinstance(expr, ast.Name):
        return lookup(tree, module, expr.id, depth + 1)
    if isinstance(expr, ast.Attribute):
        owner = resolve_expr(tree, module, expr.value, depth)
        if owner is not None and owner.kind == "module":
            return lookup(tree, owner.module, expr.attr, depth + 1)
    return None


@dataclass
class Members:
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef]
    fields: set[str]


def _is_static(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)


def _self_attributes(method: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[str]:
    """Names a method assigns on ``self`` (``self.x = …``, ``self.x: T = …``, ``self.x += …``)."""
    for node in ast.walk(method):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        else:
            continue
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                yield t.attr


def class_members(tree: Tree, found: Found, depth: int = 0) -> Members:
    """Methods and instance/class attributes of a class, its bases' included (own first)."""
    node = found.node
    assert isinstance(node, ast.ClassDef)
    members = Members({}, set())
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            members.methods.setdefault(stmt.name, stmt)
            members.fields.add(stmt.name)  # properties read as attributes
            members.fields.update(_self_attributes(stmt))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            members.fields.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            members.fields.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    if depth < MAX_DEPTH:
        for base in node.bases:
            resolved = resolve_expr(tree, found.module, base, depth)
            if resolved is not None and resolved.kind == "class":
                inherited = class_members(tree, resolved, depth + 1)
                for name, method in inherited.methods.items():
                    members.methods.setdefault(name, method)
                members.fields |= inherited.fields
    return members


# --- checking --------------------------------------------------------------------------------


def parse_signature(spec: str) -> tuple[str, tuple[str, ...], bool]:
    """``"name(a, b, ...)"`` → ``("name", ("a", "b"), True)``; the flag: more may follow."""
    name, _, rest = spec.partition("(")
    params = tuple(p.strip() for p in rest.rstrip(")").split(",") if p.strip())
    open_ended = bool(params) and params[-1] == "..."
    return name.strip(), params[:-1] if open_ended else params, open_ended


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> tuple[str, ...]:
    """Parameter names as written (``*args``, ``**kwargs`` marked), ``self``/``cls`` dropped."""
    a = node.args
    positional = [p.arg for p in [*a.posonlyargs, *a.args]]
    if method and not _is_static(node):
        positional = positional[1:]
    return (
        *positional,
        *([f"*{a.vararg.arg}"] if a.vararg else []),
        *(p.arg for p in a.kwonlyargs),
        *([f"**{a.kwarg.arg}"] if a.kwarg else []),
    )


def signature_problem(spec: str, node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> str | None:
    name, expected, open_ended = parse_signature(spec)
    actual = parameters(node, method)
    fits = actual[: len(expected)] == expected if open_ended else actual == expected
    return None if fits else f"{name}({', '.join(actual)}), expected {spec}"


def problems_at(tree: Tree, item: Item, where: str) -> list[str]:
    """What ``item`` lacks at ``where``; empty when it is all there."""
    module, _, name = where.partition(":")
    if item.kind == "module":
        return [] if tree.module(module) is not None else ["not found"]
    if tree.module(module) is None:
        return [f"no module {module}"]
    found = lookup(tree, module, name)
    if found is None:
        return ["not found"]
    if item.kind != "attribute" and found.kind != item.kind:
        return [f"is a {found.kind}, not a {item.kind}"]
    out: list[str] = []
    if item.signature is not None and isinstance(found.node, ast.FunctionDef | ast.AsyncFunctionDef):
        problem = signature_problem(name + item.signature, found.node, method=False)
        out += [f"signature {problem}"] if problem else []
    if item.value is not NO_VALUE:
        try:
            actual = ast.literal_eval(found.node) if isinstance(found.node, ast.expr) else NO_VALUE
        except ValueError:
            actual = NO_VALUE
        if actual != item.value:
            shown = "not a literal" if actual is NO_VALUE else repr(actual)
            out.append(f"value {shown}, expected {item.value!r}")
    if item.kind == "class":
        members = class_members(tree, found)
        for spec in item.methods:
            method_name = parse_signature(spec)[0]
            method = members.methods.get(method_name)
            if method is None:
                out.append(f"method {method_name}")
            elif problem := signature_problem(spec, method, method=True):
                out.append(f"method {problem}")
        out += [f"field {f}" for f in item.fields if f not in members.fields]
    return out


@dataclass(frozen=True)
class Result:
    item: Item
    matched: str | None  # the location that satisfied the item
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.matched is not None

    def line(self) -> str:
        if self.ok:
            more = f"  (of {len(self.item.where)} locations)" if len(self.item.where) > 1 else ""
            return f"ok       {self.matched}{more}"
        return f"missing  {self.item.label}: {'; '.join(self.problems)}  [{self.item.used_by}]"


def check_item(tree: Tree, item: Item) -> Result:
    seen: list[str] = []
    for where in item.where:
        problems = problems_at(tree, item, where)
        if not problems:
            return Result(item, where, ())
        prefix = f"{where}: " if len(item.where) > 1 else ""
        seen += [prefix + p for p in problems]
    return Result(item, None, tuple(seen))


def check(tree: Tree, items: Sequence[Item] = CONTRACT) -> list[Result]:
    return [check_item(tree, item) for item in items]


def report(tree: Tree, results: Sequence[Result]) -> str:
    missing = sum(not r.ok for r in results)
    head = f"vLLM {tree.version() or '(version unknown)'} at {tree.label}"
    tail = f"{len(results)} items: {'all present' if not missing else f'{missing} missing'}"
    return "\n".join([head, *(r.line() for r in results), tail])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="vllm package dirs, dirs holding one, or wheels")
    parser.add_argument("--installed", action="store_true", help="also check the installed vllm")
    args = parser.parse_args(argv)
    try:
        paths = list(args.paths)
        if args.installed or not paths:
            paths.append(installed_vllm())
        failed = False
        for i, path in enumerate(paths):
            with open_tree(path) as tree:
                results = check(tree)
                print(("\n" if i else "") + report(tree, results))
            failed |= not all(r.ok for r in results)
    except (ValueError, OSError, SyntaxError, zipfile.BadZipFile) as e:
        print(f"vllm_contract: {e}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
