"""The cost-aware balanced layout's search, one job per file.

- ``search``: the entry (``balanced_search``, its result ``BalancedChoice``; ``balanced_runs``) and the
  exact pricing that picks;
- ``candidates``: one search's candidates over a set of spans, and the choice rules;
- ``units``: what the candidates place (units of document runs) and their work;
- ``packing``: split-and-pack (heavy units split over a few ranks, the rest packed whole);
- ``traffic``: scoring (work, K/V received and sent, a node's IB time under the hierarchical exchange);
- ``nodes``: two levels (the node-level and per-node searches, range swaps inside and between nodes);
- ``swaps``: equal-length range swaps, the local search that unloads the busiest rank;
- ``tuning``: the constants that steer the search (``BalancedTuning``, ``DEFAULT_TUNING``).
"""

from .search import BalancedChoice, ChosenTables, balanced_runs, balanced_search
from .tuning import DEFAULT_TUNING, BalancedTuning
from .units import RunSpec

# The default tuning's, by their old names (``layout`` re-exports BALANCE_GOAL).
BALANCE_GOAL = DEFAULT_TUNING.balance_goal
SPLIT_THRESHOLDS = DEFAULT_TUNING.split_thresholds

__all__ = ["balanced_search", "balanced_runs", "BalancedChoice", "ChosenTables", "BalancedTuning", "DEFAULT_TUNING",
           "BALANCE_GOAL", "SPLIT_THRESHOLDS", "RunSpec"]
