"""The layouts: who owns which global positions of the padded sequence.

- ``balanced/``: the cost-aware balanced layout's search (``balanced_runs``), split by job;
  its strategy class, ``BalancedLayout``, is in ``../layout.py`` with the others;
- ``contiguous``, ``zigzag`` and ``thd`` (and ``build_layout``, ``Layout``): still in
  ``../layout.py`` for now.
"""
