"""Golden vectors: the cases with their inputs and float64 expected values, as ``.npz`` files.

``export(DIR)`` writes one ``<case>__<dtype>.npz`` per case and dtype, plus ``manifest.json``
(SHA-256 of every file, the tolerances, the format version) into a new or empty directory (never
over an earlier export). Each file holds:

* ``in:<name>``: the inputs exactly as backends receive them (bfloat16 stored as its uint16 bits;
  ``meta`` records each input's dtype): the ``sinks`` of a case with sinks, and a merge case's
  split of the keys, ``key_part`` (int64 ``(kv_len,)``, with its option ``parts``);
* ``expected:<step>`` covers the new steps too: ``lse`` and ``blockwise_lse`` of every sdpa
  case, ``grad_sinks`` where it has sinks, ``merge_output`` and ``merge_lse`` of a merge case;
* ``expected:<step>``: the float64 reference value of every step;
* ``baseline:<step>``: the measured error of the naive implementation in that dtype;
* ``zeros:<step>``: positions that must be exactly 0;
* ``any:<step>``: positions where the spec's NaN rule allows any value (format 2);
* ``table:mask_mod``, ``table:score_mod``: a case's mods tabulated (format 3, below);
* ``meta``: JSON (case, dtype, kind, scalar options, input dtypes, format).

Everything loads without pickles. ``check(DIR, backends)`` verifies the checksums and runs the
loaded expectations through the runner (``runner.run_expectations``), exactly as
``python -m conformance run`` does, needing nothing but NumPy and the implementation under test.
A ``--case`` pattern or ``--dtype`` that selects no file of the folder is an error.

Golden folders are untrusted input: a folder handed over by someone else may be stale, truncated
or crafted. Every problem is a ``GoldenError`` (a ``UsageError``: ``python -m conformance``
prints one line naming the file and exits with code 2), found before any backend runs:

* ``manifest.json`` is a JSON object (at most ``MAX_MANIFEST_BYTES``) with a readable
  ``format`` and a non-empty ``files`` object mapping plain file names ``<case>__<dtype>.npz``
  (a known case and dtype: no path separators, no ``..``, not absolute) to 64 lowercase hex
  digits. The whole manifest is validated before any listed file is read, and every listed file
  is checked with ``lstat`` first: a symlink, a non-regular file or one over ``MAX_FILE_BYTES``
  is refused unread (files are opened with ``O_NOFOLLOW`` where the system has it);
* a ``.npz`` in the folder that the manifest does not list is refused (a stale or planted file);
* each file is a zip of ``.npy`` members whose headers are read before any data: only plain
  bool, integer, float (and, for ``meta``, unicode) dtypes, at most ``MAX_ARRAY_BYTES`` per
  array and ``MAX_LOADED_BYTES`` per file, at most ``MAX_MEMBERS`` members;
* the arrays have the structure ``save`` writes: valid ``meta`` (a known case of its kind, a
  dtype of ``DTYPES``, a readable format, option keys the case kind takes, a module case naming
  its own module), every input named in ``meta`` present with the dtype declared there, at
  least one ``expected:<step>`` of a step the harness knows, each with its 0-d
  ``baseline:<step>``, and ``zeros:``/``any:`` masks of their step's shape; a merge case's
  ``parts`` an int in ``[1, MAX_PARTS]`` and its ``key_part`` ints ``(kv_len,)`` in
  ``[0, parts)``; a varlen case's offsets ``(N + 1,)`` ints from 0 to its tokens,
  non-decreasing, ``max_q``/``max_k`` at least the longest sequence; a mod option naming a mod
  of ``cases.mods`` with its parameters, its arrays and the slopes and segment ids shaped
  as their rule needs, and the ``table:`` arrays exactly the tabulation of the file's own mod
  (``packed``). ``check`` also requires ``meta``'s case and dtype to be those of the file's
  name.

Packed batches, chunks, ALiBi, segment ids and mods (``packed``): a varlen case's inputs are
``in:query``/``key``/``value`` tokens first with ``in:cu_seq_q``, ``in:cu_seq_k`` (int32) and
its options ``max_q``, ``max_k``, ``window_size``, ``enable_gqa`` in ``meta``; an sdpa case
carries ``in:alibi_slopes``, ``in:q_segment_ids``/``in:kv_segment_ids``, option ``chunk_size``,
and a mod as its option (name and parameters), its input arrays ``in:mod_*`` and, for a kernel
author, ``table:mask_mod`` (bool, the scores' shape: the mask_mod evaluated everywhere) and
``table:score_mod`` (float64: an additive score mod's bias).

``export`` and ``load`` trust the path they are given (``load`` follows a symlink you name);
they distrust the contents.
"""

from .files import (
    FORMAT,
    INPUT_DTYPES,
    MAX_FILE_BYTES,
    MAX_PARTS,
    OPTION_KEYS,
    READABLE_FORMATS,
    GoldenError,
    load,
    parse,
    save,
)
from .folders import MANIFEST, MAX_MANIFEST_BYTES, check, export, verify
from .untrusted import MAX_ARRAY_BYTES, MAX_HEADER_BYTES, MAX_LOADED_BYTES, MAX_MEMBERS

__all__ = ["FORMAT", "INPUT_DTYPES", "MANIFEST", "MAX_ARRAY_BYTES", "MAX_FILE_BYTES", "MAX_PARTS",
           "MAX_HEADER_BYTES", "MAX_LOADED_BYTES", "MAX_MANIFEST_BYTES", "MAX_MEMBERS",
           "OPTION_KEYS", "READABLE_FORMATS", "GoldenError", "check", "export", "load", "parse",
           "save", "verify"]
