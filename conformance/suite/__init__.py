"""The conformance check as a pytest suite, to run in your own CI (``docs/checking.md``, "In
your CI")::

    pip install attention-three-ways pytest-xdist
    pytest --pyargs conformance.suite --attention-backend mypkg.attention -n auto --junitxml=r.xml
    pytest --pyargs conformance.suite --attention-backend mypkg.attention --attention-profile full

One item per case × dtype × compared step (``test_cell[gqa-float32-output]``), per bad input
(``test_bad_input[mask_not_bool]``) and for the property checks (``test_properties[<module>]``);
the rows (case × dtype) and property examples are the profile's (``quick`` by default, ``full``
for every case in every dtype). A failing item says the harness's diagnosis and the rerun
command; the terminal summary explains each bug once, with its smallest failing case as a script.

==============  =========================================================================
``plugin``      the pytest plugin (entry point ``pytest11``): options, collection, the module
                imported before any item runs, xdist's scheduling, "nothing was checked"
``config``      the options (``--attention-*``, ``$ATTENTION_BACKEND``) and this process's
                ``Suite``
``checks``      the items, collected from its own file
``outcomes``    ``Suite``: what each item checks and says, with the harness's machinery
                (``profiles``, ``runner.run_cell``, ``run_errors``, ``properties``, ``shrink``)
``summary``     the terminal summary: the failures grouped by diagnosis (``groups``)
==============  =========================================================================
"""
