"""What every Envoy of one wrapped model shares: module aliases (``rename=``) and custom Envoy
classes (``envoys=``).

    Tree(module, rename, envoys)   resolved once when the model is wrapped
    Tree.alias(mpath, name)        the path (relative to the module at ``mpath``) an alias names
    Tree.envoy_class(m, mpath, d)  the Envoy class for a module (``envoys=``)
    tree_repr(module, tree)        ``print(model)`` with aliases shown as ``alias/name``

Aliases are resolved against the module tree by *path* (``named_modules()`` names), so they
survive a model whose weights are loaded later (``LanguageModel`` builds its tree on the meta
device first). A Tree holds no reference to any Envoy, so a wrapper is freed by reference
counting when the user drops it.

``rename`` keys, as in nnsight:

    "mlp"             every module with a child ``mlp`` gets the alias for it
    "transformer.h"   a dotted path: mounted on the root under the alias (one that does not
                      resolve from the root, ``"h.0"``, is bound where it resolves, as ".h.0")
    ".h"              a leading dot: bound on whichever module has that path below it
    "*.h"             ``*`` stands for any one child name (one match per module, else an error)
    SomeModuleClass   bound on every module with exactly one direct child of that class

A value is one alias or a list of aliases. A dotted alias (``{"attn.c_proj": "attn.o_proj"}``)
is bound where its leading names lead: ``o_proj`` on each ``attn``. A key that names nothing is
skipped (one ``rename`` can then serve several architectures); an alias that would hide
something (an Envoy attribute, a child module, an attribute of the module, another alias) is
refused with a ValueError.
"""

from __future__ import annotations

import fnmatch

import torch


def child_module(module: torch.nn.Module, name: str):
    """``module._modules.get(name)``: the child module ``name`` or None, also for a TorchScript
    module (``torch.jit.script``/``trace``), whose ``_modules`` is an ``OrderedModuleDict`` with
    no ``get``."""
    children = module._modules
    try:
        return children.get(name)
    except AttributeError:
        return children[name] if name in children else None


class Tree:
    """The aliases and Envoy classes of one wrapped model (see the module docstring).

    Example::

        model = NNsight(net, rename={"layers": "blocks"}, envoys={torch.nn.Linear: MyEnvoy})
        model.blocks[0] is model.layers[0]      # True: the same Envoy
    """

    __slots__ = ("aliases", "classes")

    def __init__(self, root: torch.nn.Module, rename=None, envoys=None, reserved=frozenset()):
        #: module path ("" = root) -> {alias: path of names below that module}
        self.aliases: dict[str, dict[str, tuple]] = {}
        #: [(key, Envoy subclass)]: a module class, or a dotted path suffix (``*`` allowed)
        if isinstance(envoys, type) and _is_envoy_class(envoys):  # one class for every
            envoys = {torch.nn.Module: envoys}  # module's Envoy (as nnsight takes it)
        elif envoys is not None and not hasattr(envoys, "items"):
            raise TypeError(
                f"envoys= takes an Envoy subclass (for every module) or a dict of them by module "
                f"class or path suffix, got {envoys!r}")
        self.classes: list = list((envoys or {}).items())
        for key, cls in self.classes:
            if not (isinstance(cls, type) and _is_envoy_class(cls)):
                raise TypeError(f"envoys={{{key!r}: {cls!r}}}: the value must be an Envoy subclass")
            if not isinstance(key, (str, type)):
                raise TypeError(
                    f"envoys= keys are module classes or dotted path suffixes, got {key!r}"
                )
        if rename:
            self._resolve(root, dict(rename), reserved)

    # ---- rename

    def _resolve(self, root, rename: dict, reserved) -> None:
        modules = dict(root.named_modules(remove_duplicate=False))
        for key, value in rename.items():
            names = [value] if isinstance(value, str) else list(value)
            if not names or not all(map(_is_alias, names)):
                raise ValueError(
                    f"rename={{{key!r}: {value!r}}}: an alias is a Python name, or a dotted path "
                    "ending in one (\"attn.o_proj\"), or a list of them"
                )
            for where, rel in self._targets(key, modules):
                for alias in names:
                    at, alias, below = _mount(where, alias, rel, key)
                    self._bind(modules[at], at, alias, below, reserved, key)

    def _targets(self, key, modules: dict):
        """(module path, path below it) pairs the key names."""
        if isinstance(key, type):
            for path, module in modules.items():
                hits = [n for n, c in module._modules.items() if isinstance(c, key)]
                if len(hits) > 1:
                    raise ValueError(
                        f"rename key {key.__name__} matches {len(hits)} children of "
                        f"{_label(path)} ({', '.join(hits)}); an alias names one module: key "
                        "those children by name instead"
                    )
                if hits:
                    yield path, (hits[0],)
            return
        if not isinstance(key, str) or not key.strip("."):
            raise TypeError(f"rename keys are module names, dotted paths or classes, got {key!r}")
        if "." in key and not key.startswith("."):  # mounted on the root
            found = list(_match(modules[""], tuple(key.split(".")), ""))
            if found:
                yield "", found[0]
                return
            key = "." + key  # names nothing from the root: bound where it resolves, as nnsight
        if key.startswith("."):  # resolved below every module
            parts = tuple(key[1:].split("."))
            for path, module in modules.items():
                for rel in _match(module, parts, path):
                    yield path, rel
        elif "*" in key:  # ("*" alone) mounted on the root
            found = list(_match(modules[""], tuple(key.split(".")), ""))
            if found:
                yield "", found[0]
        else:  # one component: wherever a module has that child
            for path, module in modules.items():
                if key in module._modules and module._modules[key] is not None:
                    yield path, (key,)

    def _bind(self, module, where: str, alias: str, rel: tuple, reserved, key) -> None:
        if rel == (alias,):  # aliasing a name to itself: nothing to do
            return
        here = self.aliases.setdefault(where, {})
        if alias in here and _below(module, here[alias]) is _below(module, rel):
            return  # (the same module by two names: a tied or shared child)
        clash = None
        if alias in reserved:
            clash = "an attribute of nnsight_lite's Envoy"
        elif alias in module._modules:
            clash = "a child module of that name"
        elif alias in here:
            clash = f"the alias {alias!r} an earlier key already gave to {'.'.join(here[alias])}"
        elif hasattr(module, alias):
            clash = f"an attribute of the {type(module).__name__} module"
        if clash is not None:
            raise ValueError(
                f"rename alias {alias!r} for {key!r} would hide {clash} on {_label(where)}; "
                "choose another alias"
            )
        here[alias] = rel

    def alias(self, mpath: str, name: str):
        """The names below the module at ``mpath`` that alias ``name`` stands for, or None."""
        here = self.aliases.get(mpath)
        return here.get(name) if here else None

    # ---- envoys

    def envoy_class(self, module, mpath: str, default):
        """The Envoy class for ``module`` at ``mpath`` (its named_modules path): a class match
        first, then a path-suffix match of the native path, then of a path through aliases."""
        native = tuple(mpath.split(".")) if mpath else ()
        for key, cls in self.classes:
            if isinstance(key, type) and isinstance(module, key):
                return cls
        for key, cls in self.classes:
            if isinstance(key, str) and _suffix(native, key):
                return cls
        if self.aliases:
            others = self._alias_paths(native) - {native}
            for key, cls in self.classes:
                if isinstance(key, str) and any(_suffix(p, key) for p in others):
                    return cls
        return default

    def _alias_paths(self, native: tuple) -> set:
        """``native`` and every path that reaches the same module through aliases."""
        found = {native}
        for _ in range(4):  # aliases compose through ancestors; a few rounds are plenty
            new = set()
            for where, here in self.aliases.items():
                w = tuple(where.split(".")) if where else ()
                for alias, rel in here.items():
                    n, k = len(w), len(rel)
                    for p in found:
                        if p[:n] == w and p[n:n + k] == rel:
                            new.add(p[:n] + (alias,) + p[n + k:])
            if new <= found:
                break
            found |= new
        return found


def _is_alias(name) -> bool:
    """A Python name, or a dotted path of child names ending in one (``"h.1.ln"``)."""
    if not isinstance(name, str):
        return False
    *lead, last = name.split(".")
    return last.isidentifier() and all(p.isidentifier() or p.isdigit() for p in lead)


def _mount(where: str, alias: str, rel: tuple, key) -> tuple:
    """Where a dotted alias is bound: ``{"attn.c_proj": "attn.o_proj"}`` names ``c_proj`` of
    each ``attn`` ``o_proj`` there, so the alias's leading names must lead to where the key's
    module sits. Returns (module path, alias, names below it)."""
    if "." not in alias:
        return where, alias, rel
    *lead, name = alias.split(".")
    if tuple(lead) != rel[:len(lead)] or len(lead) >= len(rel):
        raise ValueError(
            f"rename={{{key!r}: {alias!r}}}: a dotted alias names the same modules as its key "
            f"up to its last name (here {'.'.join(rel)} below {_label(where)}); write "
            f"{'.'.join(rel[:-1] + (name,))!r}, or a plain name to alias it where the key "
            "points"
        )
    at = ".".join(p for p in (where, *lead) if p)
    return at, name, rel[len(lead):]


def _is_envoy_class(cls) -> bool:
    from .envoy import Envoy

    return issubclass(cls, Envoy)


def _match(module, parts: tuple, where: str):
    """Paths below ``module`` matching ``parts`` (``*`` = any one name); more than one match
    for a ``*`` is an error, since an alias names one module."""
    if not parts:
        yield ()
        return
    head, rest = parts[0], parts[1:]
    if head == "*":
        hits = [(n, c) for n, c in module._modules.items()
                if c is not None and next(_match(c, rest, f"{where}.{n}" if where else n),
                                          None) is not None]
        if len(hits) > 1:
            raise ValueError(
                f"rename key component '*' matches {len(hits)} children of {_label(where)} "
                f"({', '.join(n for n, _ in hits)}); an alias names one module: spell the name"
            )
    else:
        child = child_module(module, head)
        hits = [(head, child)] if child is not None else []
    for name, child in hits:
        for tail in _match(child, rest, f"{where}.{name}" if where else name):
            yield (name,) + tail


def _suffix(parts: tuple, key: str) -> bool:
    want = key.strip(".").split(".")
    if len(want) > len(parts):
        return False
    tail = parts[len(parts) - len(want):]
    return all(fnmatch.fnmatchcase(p, w) if w == "*" else p == w for p, w in zip(tail, want))


def _below(module, rel: tuple):
    """The module at the names ``rel`` below ``module``."""
    for name in rel:
        module = module._modules[name]
    return module


def _label(mpath: str) -> str:
    return "model" + ("." + mpath if mpath else "")


def tree_repr(module: torch.nn.Module, tree: Tree, mpath: str = "") -> str:
    """``repr(module)`` in torch's layout, with each aliased child shown as ``(alias/name)`` and
    each deeper mount on a line of its own."""
    here = tree.aliases.get(mpath, {})
    direct: dict = {}
    mounts = []
    for alias, rel in here.items():
        if len(rel) == 1:
            direct.setdefault(rel[0], []).append(alias)
        else:
            mounts.append((alias, rel))
    extra = module.extra_repr()
    lines = extra.split("\n") if extra else []
    for name, child in module._modules.items():
        if child is None:
            continue
        sub = tree_repr(child, tree, f"{mpath}.{name}" if mpath else name)
        label = "/".join(direct.get(name, []) + [name])
        lines.append(f"({label}): " + sub.replace("\n", "\n  "))
    for alias, rel in mounts:
        target = module.get_submodule(".".join(rel))
        lines.append(f"({alias}): {type(target).__name__}(-> {'.'.join(rel)})")
    head = module._get_name() + "("
    if not lines:
        return head + ")"
    if len(lines) == 1 and not module._modules:
        return head + lines[0] + ")"
    return head + "\n  " + "\n  ".join(lines) + "\n)"
