"""The cost-aware balanced layout's search, one job per file, and its strategy class.

- ``search``: the entry (``balanced_search``, its result ``BalancedChoice``; ``balanced_runs``) and the
  exact pricing that picks;
- ``candidates``: one search's candidates over a set of spans, and the choice rules;
- ``units``: what the candidates place (units of document runs) and their work;
- ``packing``: split-and-pack (heavy units split over a few ranks, the rest packed whole);
- ``traffic``: scoring (work, K/V received and sent, a node's IB time under the hierarchical exchange);
- ``nodes``: two levels (the node-level and per-node searches, range swaps inside and between nodes);
- ``swaps``: equal-length range swaps, the local search that unloads the busiest rank;
- ``tuning``: the constants that steer the search (``BalancedTuning``, ``DEFAULT_TUNING``);
- ``layout``: its strategy class, ``BalancedLayout`` (what ``layouts.build_layout`` calls).
"""

from .layout import BalancedLayout
from .search import BalancedChoice, ChosenTables, balanced_runs, balanced_search
from .tuning import DEFAULT_TUNING, BalancedTuning

# The default tuning's balance goal and split thresholds, by name.
BALANCE_GOAL = DEFAULT_TUNING.balance_goal
SPLIT_THRESHOLDS = DEFAULT_TUNING.split_thresholds

__all__ = ["BalancedLayout", "balanced_search", "balanced_runs", "BalancedChoice", "ChosenTables", "BalancedTuning",
           "DEFAULT_TUNING", "BALANCE_GOAL", "SPLIT_THRESHOLDS"]
