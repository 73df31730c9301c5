"""Comparing: one result against its expected value, and what a run produces.

==============  ================================================================================
``compare``     the one tolerance rule (``compare``, ``compare_step``): a step's result against
                its float64 expected value, within ``atol + rtol·|expected| + k·e`` (e: the
                naive baseline's error in the same dtype); ``StepResult``
``results``     ``Cell``, ``Column``, ``RunResult`` and the other result types a run produces
                and every report reads
==============  ================================================================================
"""
