"""How a per-layer computation over a pool is cut into programs of a few layers each.

XLA inlines everything one program holds, so a program over all of a model's layers costs what its layers cost to
compile (SmolLM2's 30: 1.3 to 1.8 s a forward shape, about 2 s a whole-pool scatter), and a program per layer makes a
call per layer (32 calls a decode step made it 25% slower). A few layers a program, the same program for every group
of that size, keeps the compile from growing with the depth and the calls few: the forward pass
(``model/programs.py``) and the CPU scatter (``cpu_copy.py``) both run this way.
"""

from __future__ import annotations

import os

# Layers per program, roughly. Fewer calls matter more where a call costs more than on CPU: an accelerator node may
# want the whole model in one program (a large value).
LAYERS_PER_PROGRAM = int(os.environ.get("FSM_PD_LAYERS_PER_PROGRAM", "6"))


def layer_groups(num_layers: int, target: int = LAYERS_PER_PROGRAM) -> list[tuple[int, int]]:
    """``(first layer, count)`` of each group, in order, covering ``num_layers`` once.

    Groups of one size where the depth allows it (a divisor of ``num_layers`` near ``target``: SmolLM2's 30 layers
    are 5 groups of 6), so one program serves every group; otherwise near-equal groups, of two sizes at most."""
    target = max(1, target)
    sizes = [d for d in range(max(1, target // 2), 2 * target + 1) if num_layers % d == 0]
    if sizes:
        size = min(sizes, key=lambda d: (abs(d - target), -d))
        return [(first, size) for first in range(0, num_layers, size)]
    count = -(-num_layers // target)
    base, extra = divmod(num_layers, count)
    groups, first = [], 0
    for size in [base] * (count - extra) + [base + 1] * extra:
        groups.append((first, size))
        first += size
    return groups


def group_sizes(num_layers: int, target: int = LAYERS_PER_PROGRAM) -> list[int]:
    """The distinct sizes of ``layer_groups``: one program each."""
    return sorted({count for _, count in layer_groups(num_layers, target)})
