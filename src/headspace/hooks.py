"""Named hook points, as in TransformerLens.

A :class:`HookPoint` is an identity sub-module placed at an intermediate value of a layer
(``hook_q``, ``hook_pattern`` ...). Its full name is its module path (``blocks.2.attn.hook_pattern``).
Functions added to it see the value and may return a replacement (patching, ablation).

Layers check :attr:`HookPoint.active` and take their fast path while no hook point of theirs has a
function: an untraced module pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

HookFn = Callable[[Tensor, "HookPoint"], Tensor | None]


class HookPoint(nn.Module):
    """An identity point that named functions can read or replace.

    ``fn(value, hook_point) -> None | Tensor``: return None to leave the value, a tensor to replace it
    (it must have the same shape).
    """

    def __init__(self) -> None:
        super().__init__()
        self.fns: list[HookFn] = []
        self.name: str = ""

    @property
    def active(self) -> bool:
        return bool(self.fns)

    def add(self, fn: HookFn) -> Callable[[], None]:
        """Add ``fn``; returns a function that removes it again."""
        self.fns.append(fn)

        def remove() -> None:
            if fn in self.fns:
                self.fns.remove(fn)

        return remove

    def clear(self) -> None:
        self.fns.clear()

    def fire(self, value: Tensor) -> Tensor:
        """Run every function on ``value`` in order; return the (possibly replaced) value."""
        for fn in list(self.fns):
            out = fn(value, self)
            if out is not None:
                if not isinstance(out, Tensor) or out.shape != value.shape:
                    got = list(out.shape) if isinstance(out, Tensor) else type(out).__name__
                    raise ValueError(
                        f"hook on {self.name or 'hook point'} must return None or a tensor of shape "
                        f"{list(value.shape)}; got {got}"
                    )
                if out.dtype != value.dtype or out.device != value.device:
                    raise ValueError(
                        f"hook on {self.name or 'hook point'} must return a tensor of the value's dtype "
                        f"{value.dtype} on {value.device}; got {out.dtype} on {out.device}"
                    )
                value = out
        return value

    def forward(self, value: Tensor) -> Tensor:
        return self.fire(value)

    def extra_repr(self) -> str:
        return f"n_fns={len(self.fns)}"


def name_hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Give every hook point in ``model`` its full module path as name; return them by name."""
    points = {}
    for name, module in model.named_modules():
        if isinstance(module, HookPoint):
            module.name = name
            points[name] = module
    return points
