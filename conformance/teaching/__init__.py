"""The seed article, taught with the harness's own parts (beside the run, never imported by it).

=============================  ==============================================================
``walkthrough_steps``          the article's steps, computed in each backend and in float64
``walkthrough``                ``python -m conformance walkthrough``: prints them side by side
``pictures``                   ``python -m conformance pictures DIR``: attention-weight heatmaps
``exercise_kit``               the graded exercises' parts: checks, planted mistakes, inputs
``exercise_catalogue``         exercises 1–6 (scores … both causal methods) and ``EXERCISES``
``exercise_catalogue_heads``   exercises 7–10 (padding, multi-head, grouped-query, backward)
``exercises``                  ``python -m conformance exercise N``: grades a learner's file
=============================  ==============================================================

The article's data (``conformance.spec.seed_example``) lives with the spec: the case catalogue
(``conformance.cases``) uses it too, and it sits below both, so imports run one way.
"""
