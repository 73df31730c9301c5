"""The seed article, taught with the harness's own parts (beside the run, never imported by it).

===================  ======================================================================
``walkthrough_steps``  the article's steps, computed in each backend and in float64
``walkthrough``      ``python -m conformance walkthrough``: prints them side by side
``pictures``         ``python -m conformance pictures DIR``: attention-weight heatmaps
===================  ======================================================================

The article's data (``conformance.spec.seed_example``) lives with the spec: the case catalogue
(``conformance.cases``) uses it too, and it sits below both, so imports run one way.
"""
