"""Generate stage 1 and stage 2 as ``torch.fx.GraphModule``s from a cut of the traced graph.

Stage 1 is the traced graph restricted to the ancestors of the boundary; it takes the step's
inputs and returns ``{key: tensor}``. Stage 2 is the graph from the boundary to the output; it
takes the boundary as keyword arguments and returns what the step returned. Each stage holds only
the attributes its nodes reference, as the *same objects* as the model (an optimizer built on the
model still works, checkpoints keep their names), so stage 2 never holds the frozen modules whose
work moved to stage 1 and they may stay on ``meta`` in a training process.

In: traced graph, :class:`~graphsplit.artifacts.Cut`, boundary keys, the model and trace
constants.
Out: two GraphModules.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from graphsplit.artifacts import Cut
from graphsplit.errors import Fix, MetaParameterError, SplitError, user_error
from graphsplit.planning.codegen.compiled_calls import call_compiled_modules
from graphsplit.planning.codegen.stage_passes import (
    finish_stage1,
    finish_stage2,
    finish_stage2_module,
)
from graphsplit.planning.cut.number_twins import size_on_twin
from graphsplit.planning.cut.twin_reads import read_on
from graphsplit.planning.meta.meta_interpreter import fetch
from graphsplit.planning.rules.baked_sizes import bake_numbers
from graphsplit.planning.rules.opaque_call import OPAQUE, OpaqueCall, is_opaque, recheck_shapes
from graphsplit.planning.rules.size_guards import SIZE_CHECKS


class MetaTensorCheck:
    """Forward pre-hook: a stage must not run while it holds a tensor on ``meta``.

    It runs before every call of the stage, so it is kept cheap: the parameter and buffer
    dicts of the stage's modules are gathered on the first call and only their current
    values are looked at afterwards (a weight loaded with ``assign=True`` or moved with
    ``.to()`` is a new value in the same dict). A walk of ``named_parameters()`` and
    ``named_buffers()`` each call cost 3.4 ms of CPU on an SD-1.5-shaped LoRA UNet (942 tensors
    in 1,989 modules), this 0.07 ms (``bench_dispatch --meta-check``); the names are looked up
    only to refuse. The gathered dicts are not pickled: a copied stage gathers its own.
    """

    def __init__(self) -> None:
        self._held: tuple[dict[str, Any], ...] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"_held": None}

    def __deepcopy__(self, memo: dict[int, Any]) -> MetaTensorCheck:
        return MetaTensorCheck()

    def __call__(self, stage: nn.Module, args: Any) -> None:
        held = self._held
        if held is None:
            held = self._held = tuple(
                tensors
                for module in stage.modules()
                for tensors in (module._parameters, module._buffers)
                if tensors  # a buffer a forward registers later is made there, not on meta
            )
        for tensors in held:
            for tensor in tensors.values():
                if tensor is not None and tensor.is_meta:
                    _refuse_meta_tensors(stage)


def _refuse_meta_tensors(stage: nn.Module) -> None:
    """Raise naming the first tensor of ``stage`` on ``meta``."""
    for kind, tensors in (
        ("parameter", stage.named_parameters()),
        ("buffer", stage.named_buffers()),
    ):
        for name, tensor in tensors:
            if tensor.is_meta:
                raise user_error(
                    MetaParameterError,
                    f"{type(stage).__name__} holds the {kind} {name!r} on the meta device, so it"
                    " cannot run.",
                    fix=Fix(
                        "load real weights into the modules this stage uses (e.g. "
                        "load_state_dict(..., assign=True) or build them on a real device); "
                        "graphsplit only leaves the *other* stage's modules on meta"
                    ),
                )


def _module(
    graph: fx.Graph, model: nn.Module, constants: dict[str, Any], name: str
) -> fx.GraphModule:
    constants = name_constants(graph, model, constants)
    call_compiled_modules(graph, model)  # the user's torch.compile'd object, not _orig_mod
    targets = sorted(
        {node.target for node in graph.nodes if node.op in ("get_attr", "call_module")},
        key=lambda target: (target.count("."), target),
    )
    root = {target: fetch(model, constants, target) for target in targets}
    stage = fx.GraphModule(root, graph, class_name=name)
    _hold_opaque_reads(stage, graph, model)
    for target, value in constants.items():
        if target in root and isinstance(value, torch.Tensor):
            # A traced constant is not the model's state: kept out of the state dict, so the
            # stage's keys are the model's own (checkpoints load both ways, strict).
            delattr(stage, target)
            stage.register_buffer(target, value, persistent=False)
    _follow_model_order(stage, model)
    stage.register_forward_pre_hook(MetaTensorCheck())
    return stage


def _hold_opaque_reads(stage: nn.Module, graph: fx.Graph, model: nn.Module) -> None:
    """Register the frozen tensors opaque calls read on ``stage``, at the model's own paths.

    An opaque call runs the user's function on the objects it was called with, so nothing in
    the graph names the weights it uses; held by the stage, they are in its state dict and its
    weights fingerprint (a changed text encoder invalidates the cache), move with ``.to()``,
    and the stage refuses to run while one is on ``meta``.
    """
    for node in graph.nodes:
        if not is_opaque(node):
            continue
        for target in node.meta[OPAQUE].reads:
            *path, attribute = target.split(".")
            owner, holder = model, stage
            for part in path:
                owner = getattr(owner, part)
                if part not in holder._modules:
                    holder.add_module(part, nn.Module())
                holder = holder._modules[part]
            if attribute in holder._parameters or attribute in holder._buffers:
                continue
            tensor = getattr(owner, attribute)
            if isinstance(tensor, nn.Parameter):
                holder.register_parameter(attribute, tensor)
            else:
                persistent = attribute not in owner._non_persistent_buffers_set
                holder.register_buffer(attribute, tensor, persistent=persistent)


def name_constants(graph: fx.Graph, model: nn.Module, constants: dict[str, Any]) -> dict[str, Any]:
    """Rename the graph's traced constants after where they came from; the renamed table.

    fx calls a tensor it met outside the model's parameters and buffers ``_tensor_constant0``;
    when it is an attribute of a helper object the model holds (``scheduler.alphas_cumprod``)
    it becomes ``scheduler_alphas_cumprod``, else ``constant_0``.
    """
    origins: dict[int, str] | None = None  # scanned only if a constant needs a name
    new_names: dict[str, str] = {}
    taken = {n.target for n in graph.nodes if n.op in ("get_attr", "call_module")}
    for node in graph.nodes:
        if node.op != "get_attr" or node.target not in constants:
            continue
        if node.target not in new_names:
            new_names[node.target] = node.target
            if node.target.startswith("_tensor_constant"):
                origins = _constant_origins(model) if origins is None else origins
                base = origins.get(id(constants[node.target]), "constant")
                candidate, index = base, 0
                while candidate in taken or hasattr(model, candidate):
                    candidate, index = f"{base}_{index}", index + 1
                taken.add(candidate)
                new_names[node.target] = candidate
        if new_names[node.target] != node.target:
            node.target = new_names[node.target]
            node._rename(node.target)
    return {new: constants[old] for old, new in new_names.items()}


def _constant_origins(model: nn.Module) -> dict[int, str]:
    """``id(tensor) -> "scheduler_alphas_cumprod"`` for tensors of the model's helper objects.

    Every attribute of every module is looked at (an SDXL step: 7,922 modules), so the cheap
    tests come first: the exact type of a plain value, then a private name.
    """
    found: dict[int, str] = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if type(value) in _PLAIN_VALUES or name.startswith("_"):
                continue
            if isinstance(value, (nn.Module, torch.Tensor, type)):
                continue
            for attribute, tensor in getattr(value, "__dict__", {}).items():
                if isinstance(tensor, torch.Tensor):
                    path = ".".join(part for part in (prefix, name, attribute) if part)
                    found.setdefault(id(tensor), path.replace(".", "_").strip("_"))
    return found


# Attribute values that hold no tensor attributes (``in_features``, ``training``, ``eps``).
_PLAIN_VALUES = frozenset({int, float, bool, str, type(None), tuple, list, dict, set})


def _follow_model_order(stage: nn.Module, model: nn.Module) -> None:
    """Order the stage's parameters, buffers and submodules as the model registers them.

    fx registers a stage's attributes in graph order; an optimizer's state dict addresses
    parameters by position, so one made on the model's parameters would map onto the wrong
    stage parameters after a reload unless both iterate in the same order. Entries the model
    has no counterpart for keep their order, after the others. fx registers every tensor it
    copies as a persistent buffer: one the model keeps out of its state dict (Llama's rotary
    ``inv_freq``, which stage 2 reads to recompute ``cos`` / ``sin``) stays out of the stage's,
    so the stage's keys are the model's own (checkpoints load both ways, strict).
    """
    _order_like(stage, model)


def _order_like(module: nn.Module, counterpart: nn.Module | None) -> None:
    """Order ``module``'s tables as ``counterpart`` (the model's module at the same path)
    orders its own, and likewise below.

    A stage module that *is* the model's module at that path is skipped with everything under
    it: its tables are the model's own, already in the model's order. So only the containers
    fx made for the stage are visited, not the thousands of modules they hold.
    """
    if module is counterpart:
        return
    if counterpart is not None:
        module._non_persistent_buffers_set |= counterpart._non_persistent_buffers_set & set(
            module._buffers
        )
        # Parameters, then buffers, then submodules: the order of the model's registration.
        tensors = {name: index for index, name in enumerate(counterpart._parameters)}
        for name in counterpart._buffers:
            tensors.setdefault(name, len(tensors))
        children = {  # an empty slot (None) is not registered: the model walk skips it
            name: index
            for index, name in enumerate(
                name for name, child in counterpart._modules.items() if child is not None
            )
        }
        for table, position in (
            (module._parameters, tensors),
            (module._buffers, tensors),
            (module._modules, children),
        ):
            if len(table) > 1:
                ordered = sorted(
                    table.items(), key=lambda item: position.get(item[0], len(position))
                )
                table.clear()
                table.update(ordered)
    for name, child in module._modules.items():
        if child is not None:
            below = counterpart._modules.get(name) if counterpart is not None else None
            _order_like(child, below)


def build_stage1(
    graph: fx.Graph, cut: Cut, keys: list[str], model: nn.Module, constants: dict[str, Any]
) -> fx.GraphModule:
    """Inputs -> ``{key: boundary tensor}``.

    The module's ``graphsplit_code_aliases`` holds stage 1's code as graphsplit 0.2 wrote it
    (fewer size checks, the same values) when it differs: the cache fingerprint accepts a
    cache made by either, so a new check never makes a cache stale.
    """
    module = _stage1(graph, cut, keys, model, constants, as_in_0_2=False)
    module.graphsplit_code_aliases = ()
    if any(node.target in SIZE_CHECKS for node in module.graph.nodes):  # else nothing to drop
        as_in_0_2 = _stage1(graph, cut, keys, model, constants, as_in_0_2=True).code
        module.graphsplit_code_aliases = (as_in_0_2,) if as_in_0_2 != module.code else ()
    recheck_shapes(graph, cut.stage2)  # opaque outputs whose sizes stage 1 baked in
    return module


def _stage1(
    graph: fx.Graph,
    cut: Cut,
    keys: list[str],
    model: nn.Module,
    constants: dict[str, Any],
    *,
    as_in_0_2: bool,
) -> fx.GraphModule:
    stage = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder" or node in cut.stage1:
            env[node] = stage.node_copy(node, env.__getitem__)
    held = finish_stage1(stage, graph, cut, env, as_in_0_2=as_in_0_2)  # size checks
    stage.output({key: env[node] for key, node in zip(keys, cut.boundary)})
    return _module(stage, model, {**constants, **held}, "Stage1")


def build_stage2(
    graph: fx.Graph, cut: Cut, keys: list[str], model: nn.Module, constants: dict[str, Any]
) -> fx.GraphModule:
    """``**boundary`` -> what the step returned."""
    stage = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for key, node in zip(keys, cut.boundary):
        env[node] = stage.placeholder(key)
        env[node].meta = dict(node.meta)
    bake_numbers(stage, cut, env)  # sizes read from frozen-only data: literals, not inputs
    for node in graph.nodes:
        if node in cut.reanchored:
            # The batch size, read off a cached tensor instead of the input it came from.
            batch_dim = cut.anchor.meta["facts"].batch_dim
            env[node] = stage.create_node(
                "call_method", "size", (env[cut.anchor], batch_dim), name=node.name
            )
            env[node].meta = dict(node.meta)
        elif node in cut.number_twins:
            # A number the step read off a tensor stage 2 lacks, read as a size of its twin.
            twin, dim = cut.number_twins[node]
            env[node] = size_on_twin(stage, node, env[twin], dim)
        elif node in cut.twin_reads:
            # ``x.shape`` of a tensor stage 2 lacks, read off its twin on the boundary.
            env[node] = read_on(stage, node, env[cut.twin_reads[node]])
        elif node in cut.stage2 or node.op == "output":
            env[node] = stage.node_copy(node, env.__getitem__)
    finish_stage2(stage, graph, cut, env)  # size guards
    return finish_stage2_module(_module(stage, model, constants, "Stage2"))  # checkpoints


# -- saved code ---------------------------------------------------------------------------------
_LOADER = '''

def _load(module: str, qualname: str) -> Any:
    value = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def _bind(stage: torch.nn.Module, root: torch.nn.Module, target: str) -> None:
    """Make ``root``'s attribute ``target`` (a dotted path) ``stage``'s, the same object."""
    *path, name = target.split(".")
    source, owner = root, stage
    for part in path:
        source = getattr(source, part)
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    value = getattr(source, name)
    if isinstance(value, torch.nn.Module):
        owner.add_module(name, value)
    else:
        setattr(owner, name, value)
'''


def standalone_source(stage: fx.GraphModule, class_name: str, header: str) -> str:
    """``stage``'s generated code as a module that runs on its own.

    ``GraphModule.code`` refers to globals fx keeps beside it (``_torch_Tensor_``, helper
    functions); here each is imported by name, and the code becomes the ``forward`` of a class
    whose constructor takes the module the attributes come from (the live stage, or a model
    with the same attribute paths) and holds the same objects.
    """
    code = stage.graph.python_code(root_module="self")
    targets = sorted(
        {node.target for node in stage.graph.nodes if node.op in ("get_attr", "call_module")}
    )
    lines = [header.rstrip("\n"), "from __future__ import annotations", ""]
    lines += ["import importlib", "import math", "from typing import Any", "", "import torch"]
    lines += [_LOADER.rstrip("\n"), ""]
    opaque = sorted(name for name, value in code.globals.items() if isinstance(value, OpaqueCall))
    lines += [
        f"{name} = {_global_expression(value)}"
        for name, value in sorted(code.globals.items())
        if name != "torch" and name not in opaque  # torch: imported above
    ]
    # An opaque call holds the live objects it was traced with (self, the pipeline): bound from
    # the stage given to __init__, whose generated forward names it the same (its class's: a
    # split's first plan dispatches through a forward set on the instance).
    lines += [f"{name} = None  # an opaque call, bound by __init__ from root" for name in opaque]
    source = code.src.strip("\n").splitlines()
    body = "\n".join("    " + line if line.strip() else "" for line in source)
    lines += [
        "",
        "",
        f"class {class_name}(torch.nn.Module):",
        f"    TARGETS = {tuple(targets)!r}",
        f"    OPAQUE_CALLS = {tuple(opaque)!r}",
        "",
        "    def __init__(self, root: torch.nn.Module) -> None:",
        "        super().__init__()",
        "        for target in self.TARGETS:",
        "            _bind(self, root, target)",
        "        for name in self.OPAQUE_CALLS:",
        "            globals()[name] = type(root).forward.__globals__[name]",
        "",
        body.rstrip(),
        "",
    ]
    return "\n".join(lines)


def _global_expression(value: Any) -> str:
    """Python source that evaluates to ``value`` in the saved module."""
    if isinstance(value, float):
        return {"inf": "math.inf", "-inf": "-math.inf", "nan": "math.nan"}.get(
            repr(value), repr(value)
        )
    if value is type(None):
        return "type(None)"
    if isinstance(value, types.ModuleType):
        return f"importlib.import_module({value.__name__!r})"
    if isinstance(value, str):  # an annotation fx spelled as a dotted name, e.g. "torch.Tensor"
        module, _, name = value.rpartition(".")
        return f"_load({module!r}, {name!r})" if module else repr(value)
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if module is None or "<" in qualname:
        raise user_error(
            SplitError,
            f"the generated code refers to {value!r}, which cannot be imported by name, so it "
            "cannot be saved as a standalone file.",
            fix=Fix("define functions the step calls (and codecs) at module level"),
        )
    return f"_load({module!r}, {qualname!r})"
