"""Classes made at run time: a library mixin in front of a model's own module class.

Patching changes a module's class (``module.__class__ = mixed_class(Mixin, type(module))``) instead of
setting a ``forward`` on the instance:

- a class travels with the module: ``copy.deepcopy`` and pickle give the copy the same behaviour, where
  a function bound at patch time would go on calling the original module (a copy's decoder would run
  the original's layers);
- Dynamo guards a module's type anyway, while a ``forward`` in the instance's ``__dict__`` adds a guard
  per module to every compiled call.

A mixed class has no importable name, so an instance pickles as "an instance of ``Mixin`` over
``Base``" (:meth:`RuntimeMixin.__reduce_ex__`): loading makes the class again where this package
imports, and state (parameters, buffers, attributes) loads as usual.
"""

from __future__ import annotations

import types

_MIXED: dict[tuple[type, type], type] = {}  # (mixin, base) -> their class
_PARTS: dict[type, tuple[type, type]] = {}  # the inverse


class RuntimeMixin:
    """Base of the library's mixins: instances of ``mixed_class(mixin, base)`` pickle and deep-copy
    (see the module docstring). A mixin's name is the prefix of its classes' names."""

    prefix = ""

    def __reduce_ex__(self, protocol):
        rebuild, args, *rest = super().__reduce_ex__(protocol)
        parts = _PARTS.get(type(self))
        if parts is not None and args and args[0] is type(self):  # copyreg.__newobj__(cls): make cls again
            return (_new_instance, parts, *rest)
        return (rebuild, args, *rest)


def mixed_class(mixin: type[RuntimeMixin], base: type) -> type:
    """The class ``<prefix><Base>`` of bases ``(mixin, base)``: the mixin's methods win, ``super()``
    in them reaches ``base``'s. Made once per pair."""
    if (mixin, base) not in _MIXED:
        name = f"{mixin.prefix}{base.__name__}"
        cls = type(name, (mixin, base), {"__module__": mixin.__module__, "__qualname__": name})
        _MIXED[mixin, base] = cls
        _PARTS[cls] = (mixin, base)
    return _MIXED[mixin, base]


def unmixed_class(cls: type, mixin: type[RuntimeMixin]) -> type | None:
    """The base ``cls`` was made over if :func:`mixed_class` made it with ``mixin``, else None."""
    parts = _PARTS.get(cls)
    return parts[1] if parts is not None and parts[0] is mixin else None


def _new_instance(mixin: type[RuntimeMixin], base: type):
    """An empty instance of ``mixed_class(mixin, base)`` (unpickling then sets its state)."""
    return object.__new__(mixed_class(mixin, base))


def set_classes(changes) -> None:
    """Give each module of ``changes`` (pairs ``(module, cls)``) its class ``cls`` (a mixed class, or the
    base back).

    A ``forward`` set on the instance would hide the class's. accelerate's hooks set one
    (``add_hook_to_module``: it runs the hook around ``_old_forward``, the module's forward when the hook
    was added): that becomes the new class's forward, so the hook goes on running around it. Any other
    instance ``forward`` raises ValueError, before any module is changed."""
    changes = list(changes)
    hooked = []
    for module, cls in changes:
        own = vars(module)
        hooked.append(getattr(own.get("_old_forward"), "__func__", None) is type(module).forward)
        if "forward" in own and not hooked[-1]:
            raise ValueError(
                f"the {type(module).__name__} module has a forward set on the instance ({own['forward']!r}), "
                f"which would hide {cls.__name__}.forward: remove it (del module.forward) before patching"
            )
    for (module, cls), hook in zip(changes, hooked):
        module.__class__ = cls
        if hook:
            module._old_forward = types.MethodType(cls.forward, module)
