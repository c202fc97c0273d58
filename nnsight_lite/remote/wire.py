"""What crosses the wire, and how references to the model are mapped on each side.

    dumps(obj, root, by_value=None)   cloudpickle ``obj``; the model's Envoys, the root, its
                                      tokenizer and backends become small references
    loads(data, root)                 unpickle, resolving those references against ``root``
                                      (the served model on the server, the meta model on the client)
    shipped_block(body)               the with-statement's source to ship, and the names it reads

Example::

    data = dumps({"h": model.layer1, "x": x}, model)      # model.layer1 -> ("envoy", "layer1")
    again = loads(data, served)                           # -> served.layer1

Only the with-block's source, the caller values it reads and (on the way back) the saved
values cross: an Envoy is pickled as its module path, never with its module, so no weights
travel; so does a module of the model met in the values (a source operation's ``self``
argument), as its path. A tensor viewing part of a bigger storage (a slice of the logits)
travels as a compact copy of what it shows. A ``tracer.cache()`` view travels as its
records and is attached to the model on the other side, so it navigates there as it did
here (``cache.model[1].output``). A client model
with persistent edits (``model.edit()``) travels as the root plus each
edit's source and the values it reads; the server applies them to a copy of the served model.
A client model wrapped with ``rename=`` / ``envoys=`` sends those aliases and Envoy classes with
its references, and the server reads the body's names through a copy wrapped the same way.
"""

from __future__ import annotations

import ast
import builtins
import io
import pickle
import threading
import types
from collections import ChainMap, OrderedDict

import cloudpickle
import torch

from ..cache_view import CacheView
from ..capture.parsing import parse
from ..capture.source import body_source
from ..envoy import Envoy
from ..errors import RemoteError

_PLAIN = frozenset({int, float, str, bytes, bool, type(None), tuple, list, dict})


def _code_reduce(code):
    """cloudpickle's reduction of a code object, keeping its filename (cloudpickle writes
    ``<dynamic-code>``): a function of the user's shipped by value then names the user's file
    in the replica's traceback, which the client shows (client.rebuild)."""
    fn, args = _CLOUDPICKLE_CODE_REDUCE(code)
    return fn, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


_CLOUDPICKLE_CODE_REDUCE = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` without the rest of its storage: pickling a view (``logits[:, -1]``, an invoke's
    rows, a cached row) writes the whole storage it views, so a small saved slice of a big
    tensor sent all of it (a reply over the byte cap). A leaf copy, requiring grad as ``t``."""
    return t.detach().clone().requires_grad_(t.requires_grad)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)

    def __init__(self, file, root):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._root = root
        self._paths = None  # id(module) -> its path in root's module tree, made when needed
        d = root.__dict__ if root is not None else {}
        self._tree = d.get("_tree")
        self._names = _tree_spec(self._tree)  # one object: pickled once, then by reference
        self._tokenizer = d.get("_tokenizer")
        self._generator = d.get("_generator")

    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and obj.layout is torch.strided and not obj.is_meta and \
                obj.untyped_storage().nbytes() > obj.numel() * obj.element_size():
            return _compact(obj).__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return super().reducer_override(obj)

    def persistent_id(self, obj):
        if type(obj) in _PLAIN:
            return None
        if isinstance(obj, Envoy):
            return self._envoy_ref(obj)
        if type(obj) is CacheView and obj._root is not None and self._root is not None and \
                obj._root._module is self._root._module:  # navigable on the other side too
            return ("cache", obj.__getstate__())
        if obj is self._tokenizer and obj is not None:
            return ("tokenizer",)
        from .client import Backend

        if isinstance(obj, Backend):  # `backend=b` in a shipped header: the server runs it here
            return ("none",)
        if isinstance(obj, torch.nn.Module):  # one of the model's: its path, never its weights
            return self._module_ref(obj)
        return None

    def _module_ref(self, module):
        paths = self._paths
        if paths is None:
            root = self._root.__dict__.get("_module") if self._root is not None else None
            paths = self._paths = {} if not isinstance(root, torch.nn.Module) else {
                id(m): p for p, m in root.named_modules(remove_duplicate=False)}
        path = paths.get(id(module))
        return None if path is None else ("module", path)

    def _envoy_ref(self, envoy: Envoy):
        d = envoy.__dict__
        if envoy is self._generator and envoy is not None:
            return ("generator",)
        if d.get("_tree") is not self._tree or self._tree is None:
            raise RemoteError(
                f"a remote body reads {d.get('_path', 'an Envoy')}, which belongs to a model other "
                "than the one this trace runs on remotely; only the traced model's modules can be "
                "used in a remote body"
            )
        if d.get("_mpath"):
            return ("envoy", d["_mpath"], self._names)
        edits = d.get("_edits", ())
        return ("root", tuple(_ship_edit(e) for e in edits), self._names)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, root):
        super().__init__(file)
        self._root = root
        self._named: dict = {}  # id(names) -> root with those aliases and Envoy classes
        self.missing: list = []  # module paths this side's model does not have

    def _base(self, names):
        """The root with the sender's aliases and Envoy classes (``rename=``, ``envoys=``)."""
        if names is None:
            return self._root
        got = self._named.get(id(names))
        if got is None:
            got = self._named[id(names)] = (names, _with_names(self._root, names))
        return got[1]

    def persistent_load(self, pid):
        kind = pid[0]
        root = self._root
        if kind == "none":
            return None
        if kind == "tokenizer":
            return root.tokenizer
        if kind == "generator":
            return root.generator
        if kind == "envoy":
            envoy = self._base(pid[2])
            try:
                for part in pid[1].split("."):
                    envoy = envoy._reach(part)
            except AttributeError:  # raised by loads() once the rest is read (see there)
                self.missing.append(pid[1])
                return None
            return envoy
        if kind == "root":
            return _with_edits(self._base(pid[2]), pid[1])
        if kind == "module":  # a module of the model (a source operation's `self` argument)
            try:
                return root._module.get_submodule(pid[1])
            except AttributeError:
                self.missing.append(pid[1])
                return None
        if kind == "cache":  # tracer.cache()'s view, attached to this side's model
            view = CacheView.__new__(CacheView)
            view.__setstate__(pid[1])
            view._root = root
            return view
        raise pickle.UnpicklingError(f"unknown reference {pid!r}")  # pragma: no cover


def dumps(obj, root, by_value=None) -> bytes:
    """cloudpickle ``obj`` with references to ``root``'s Envoys (see the module docstring).

    ``by_value``: a module whose functions and classes are pickled by value (the caller's own
    module, which the other side may not be able to import)."""
    buf = io.BytesIO()
    if by_value is None:
        _Pickler(buf, root).dump(obj)
        return buf.getvalue()
    with _BY_VALUE:  # cloudpickle's by-value registry is process-wide: one client at a time
        registered = False
        if by_value.__name__ not in cloudpickle.list_registry_pickle_by_value():
            try:  # (registered by the user, nnsight_lite.register: left so)
                cloudpickle.register_pickle_by_value(by_value)
                registered = True
            except ValueError:  # not importable by name
                pass
        try:
            _Pickler(buf, root).dump(obj)
        finally:
            if registered:
                cloudpickle.unregister_pickle_by_value(by_value)
    return buf.getvalue()


_BY_VALUE = threading.RLock()  # (nnsight_lite.register takes it too)


_SEND_DATA = ("Make such a value inside the block, or send data (tensors, numbers, strings, "
              "containers of those)")


def unpicklable(values: dict, root, by_value=None, hint: str = _SEND_DATA) -> str:
    """For a message: which of ``values`` (name -> value) cannot be pickled, and ``hint``."""
    bad = []
    for name, value in values.items():
        try:
            dumps(value, root, by_value)
        except Exception:  # noqa: BLE001 - any failure names the value
            cls = type(value)
            where = "" if cls.__module__ == "builtins" else f"{cls.__module__}."
            bad.append(f"`{name}` (a {where}{cls.__qualname__})")
    if not bad:
        return ""
    return f"; the one(s) that cannot: {', '.join(bad)}. {hint}"


class MissingModuleError(RemoteError):
    """The data names modules that ``root`` does not have; ``loaded`` is what was read (the
    request, whose header may say why: traced on another model)."""

    def __init__(self, message: str, loaded):
        super().__init__(message)
        self.loaded = loaded


def loads(data: bytes, root):
    """Unpickle ``data``, resolving model references against ``root``."""
    unpickler = _Unpickler(io.BytesIO(data), root)
    loaded = unpickler.load()
    if unpickler.missing:
        paths = ", ".join(repr(p) for p in dict.fromkeys(unpickler.missing))
        raise MissingModuleError(
            f"the values sent name the module(s) {paths}, which the model here (a "
            f"{type(root._module).__name__}) does not have: was the trace sent to the served "
            "model it was written for?", loaded)
    return loaded


# --------------------------------------------------------------------------- the shipped block

class Block:
    """A with-statement as shipped: its source (padded so line numbers are the user's), the
    user's filename, the first line, and the names it reads."""

    __slots__ = ("source", "filename", "lineno", "names", "alone")

    def __init__(self, source: str, filename: str, lineno: int, names: frozenset,
                 alone: bool = True):
        self.source = source
        self.filename = filename
        self.lineno = lineno
        self.names = names
        self.alone = alone  # must run alone: binds the context (`as t`) or prints


_blocks: OrderedDict = OrderedDict()  # id(body code) -> (code, Block)
_BLOCKS = 256


def shipped_block(body) -> Block:
    """The with-statement ``body`` was captured from, as shipped (cached per call site)."""
    key = id(body.code)
    hit = _blocks.get(key)
    if hit is not None and hit[0] is body.code:
        return hit[1]
    block = _make_block(body, body.lineno, body.end_lineno)
    _blocks[key] = (body.code, block)
    if len(_blocks) > _BLOCKS:
        _blocks.popitem(last=False)
    return block


def _make_block(body, first: int, last: int) -> Block:
    lines = body_source(body.code)
    if lines is None:  # pragma: no cover - every compiled body remembers its source
        raise RemoteError(f"the source of the block at {body.filename}:{first} is not known")
    span = lines[first - 1:last]
    head = span[0]
    indent = head[: len(head) - len(head.lstrip())]
    text = "".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in span)
    source = "\n" * (first - 1) + text
    tree = parse(source, body.filename)
    names = frozenset(
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    )
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.With) and n.lineno == first),
                None)
    alone = node is None or any(i.optional_vars is not None for i in node.items) or \
        "print" in names
    return Block(source, body.filename, first, names, alone)


def caller_values(frame, names) -> dict:
    """The values of ``names`` in ``frame`` (locals, then globals; builtins are the server's)."""
    f_locals = frame.f_locals
    f_globals = frame.f_globals
    out = {}
    for name in names:
        value = _lookup(f_locals, name)
        if value is _ABSENT and f_globals is not f_locals:
            value = _lookup(f_globals, name)
        if value is not _ABSENT:
            out[name] = value
    return {k: v for k, v in out.items() if not _is_context(v) and not _is_builtin(k, v)}


_ABSENT = object()


def _lookup(mapping, name):
    """``mapping[name]``, or _ABSENT. A body's namespace (a Scope: a block nested in a local
    session's body) holds only the body's own names and finds the caller's by indexing."""
    if type(mapping) is dict:
        return mapping.get(name, _ABSENT)
    try:
        return mapping[name]
    except KeyError:
        return _ABSENT


def _is_context(value) -> bool:
    from ..context import BodyContext

    return isinstance(value, BodyContext)


def _is_builtin(name, value) -> bool:
    return getattr(builtins, name, _NOTHING) is value


_NOTHING = object()


# --------------------------------------------------------------------------- rename, envoys

def _tree_spec(tree):
    """A model's ``rename=`` aliases and ``envoys=`` classes as data, or None (none given)."""
    if tree is None or not (tree.aliases or tree.classes):
        return None
    return (tree.aliases, tuple(tree.classes))


def _with_names(root, names):
    """``root``, or a copy of it with the aliases and Envoy classes ``names`` (the client's
    ``rename=`` / ``envoys=``, which the served model was not wrapped with)."""
    from ..aliases import Tree

    aliases, classes = names
    tree = root.__dict__.get("_tree")
    if tree is not None and tree.aliases == aliases and tuple(tree.classes) == classes:
        return root
    named = root._copy()
    tree = Tree.__new__(Tree)
    tree.aliases, tree.classes = aliases, list(classes)
    named.__dict__["_tree"] = tree
    return named


# --------------------------------------------------------------------------- edits

def _ship_edit(edit) -> tuple:
    body, snapshot, f_globals, selves = edit
    block = _make_block(body, body.lineno, body.end_lineno)
    values = {}
    for name in block.names:
        if name in snapshot:
            values[name] = snapshot[name]
        elif name in f_globals and name not in selves:
            values[name] = f_globals[name]
    values = {k: v for k, v in values.items() if not _is_builtin(k, v)}
    return (block.source, block.filename, block.lineno, values, selves)


class _EditBody:
    """What Tracer._run needs of an edit's body: its code, and where its with-statement is
    (for messages naming the edit)."""

    __slots__ = ("code", "filename", "lineno")

    def __init__(self, code, filename: str, lineno: int):
        self.code = code
        self.filename = filename
        self.lineno = lineno


def _with_edits(root, edits: tuple):
    if not edits:
        return root
    from .execute import compile_body

    edited = root._copy()
    recorded = []
    for source, filename, lineno, values, selves in edits:
        code = compile_body(source, filename, lineno)
        glb = {"__builtins__": builtins, "__name__": "__nnsight_remote__"}
        recorded.append((_EditBody(code, filename, lineno), dict(values), glb, tuple(selves)))
    edited.__dict__["_edits"] = tuple(recorded)
    return edited
