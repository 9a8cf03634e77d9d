"""Classes made at run time: a library mixin in front of a model's own module class.

Patching changes a module's class (``module.__class__ = mixed_class(Mixin, type(module))``) instead of
setting a ``forward`` on the instance:

- a class travels with the module: ``copy.deepcopy`` and pickle give the copy the same behaviour, where
  a function bound at patch time would go on calling the original module (a copy's decoder would run
  the original's layers);
- Dynamo guards a module's type anyway, while a ``forward`` in the instance's ``__dict__`` adds a guard
  per module to every compiled call.

A mixed class has no importable name, so an instance pickles as "an instance of ``Mixin`` over
``Base``" (:meth:`RuntimeMixin.__reduce_ex__`; over ``Mixin2`` over ``Base`` when its base is a mixed
class too): loading makes the class again where this package imports, and state (parameters, buffers,
attributes) loads as usual.
"""

from __future__ import annotations

import threading
import types

_MIXED: dict[tuple[type, type], type] = {}  # (mixin, base) -> their class
_PARTS: dict[type, tuple[type, type]] = {}  # the inverse
_MAKING = threading.Lock()  # one class per pair, also when threads patch models at once


class RuntimeMixin:
    """Base of the library's mixins: instances of ``mixed_class(mixin, base)`` pickle and deep-copy
    (see the module docstring).

    ``prefix`` starts the names of a mixin's classes (``<prefix><Base>``). Empty, the class takes its
    base's name *and module*: it passes for its base wherever classes are told apart by their name
    (``save_pretrained``'s ``config.architectures``, transformers' registry of what each model class
    can record for ``output_hidden_states``)."""

    prefix = ""

    def __reduce_ex__(self, protocol):
        rebuild, args, *rest = super().__reduce_ex__(protocol)
        if type(self) in _PARTS and args and args[0] is type(self):  # copyreg.__newobj__(cls): make cls again
            return (_new_instance, _recipe(type(self)), *rest)
        return (rebuild, args, *rest)


def mixed_class(mixin: type[RuntimeMixin], base: type) -> type:
    """The class of bases ``(mixin, base)`` (named as :class:`RuntimeMixin` says): the mixin's methods
    win, ``super()`` in them reaches ``base``'s. Made once per pair."""
    with _MAKING:
        if (mixin, base) not in _MIXED:
            name = f"{mixin.prefix}{base.__name__}"
            module = mixin.__module__ if mixin.prefix else base.__module__
            cls = type(name, (mixin, base), {"__module__": module, "__qualname__": name})
            _MIXED[mixin, base] = cls
            _PARTS[cls] = (mixin, base)
        return _MIXED[mixin, base]


def unmixed_class(cls: type, mixin: type[RuntimeMixin]) -> type | None:
    """The base ``cls`` was made over if :func:`mixed_class` made it with ``mixin``, else None."""
    parts = _PARTS.get(cls)
    return parts[1] if parts is not None and parts[0] is mixin else None


def _recipe(cls: type) -> tuple[type, ...]:
    """``(mixin, ..., base)``: the mixins ``cls`` was made with, outermost first, then the importable
    class under them all."""
    mixins = []
    while cls in _PARTS:
        mixin, cls = _PARTS[cls]
        mixins.append(mixin)
    return (*mixins, cls)


def _new_instance(*recipe: type):
    """An empty instance of the class :func:`_recipe` describes (unpickling then sets its state)."""
    cls = recipe[-1]
    for mixin in reversed(recipe[:-1]):
        cls = mixed_class(mixin, cls)
    return object.__new__(cls)


def _bound_forward(method, module) -> bool:
    """``method`` is ``module``'s class forward bound to ``module``."""
    return getattr(method, "__func__", None) is type(module).forward and getattr(method, "__self__", None) is module


def set_classes(changes) -> None:
    """Give each module of ``changes`` (pairs ``(module, cls)``) its class ``cls`` (a mixed class, or the
    base back).

    A ``forward`` set on the instance would hide the class's:

    - accelerate's hooks set one (``add_hook_to_module``: it runs the hook around ``_old_forward``, the
      module's forward when the hook was added): that becomes the new class's forward, so the hook goes
      on running around it;
    - one that is only the class's forward bound to the module (what ``remove_hook_from_module`` leaves)
      is dropped;
    - any other raises ValueError, before any module is changed."""
    changes = [(module, cls, _bound_forward(vars(module).get("_old_forward"), module)) for module, cls in changes]
    for module, cls, hooked in changes:
        forward = vars(module).get("forward")
        if forward is not None and not hooked and not _bound_forward(forward, module):
            raise ValueError(
                f"a {type(module).__name__} module has a forward set on the instance "
                f"({getattr(forward, '__qualname__', type(forward).__name__)}), which would hide "
                f"{cls.__name__}.forward: remove it (del module.forward) before patching or unpatching"
            )
    for module, cls, hooked in changes:
        if not hooked and "forward" in vars(module):
            del module.forward  # the class's forward, bound: a removed hook's leftover
        module.__class__ = cls
        if hooked:
            module._old_forward = types.MethodType(cls.forward, module)
