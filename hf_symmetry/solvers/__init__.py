"""The solvers of the compressing conversions, apart from the symmetry maths they use (:mod:`hf_symmetry.symmetry`:
groups, head layouts, actions, Procrustes):

* :mod:`.structures`: the structured matrix classes of ProcrustesGPT compression (``Kron``, ``GS``,
  ``LowRank``, ``Dense``): projection, weighted fitting, parameters, config entries;
* :mod:`.segments`: ProcrustesGPT's per-segment problem (an orthogonal Q of a residual segment and the
  structured matrices that touch it), and the storage of an orthogonal skip matrix;
* :mod:`.fused`: FaRR's fused attention maps and their rank reduction;
* :mod:`.linalg`: the dense linear algebra they share (SVD, eigendecompositions, row weightings, PSD
  solves, where small factorisations run, the thread limit).

Float64 results throughout; :mod:`hf_symmetry.conversion.compress` and :mod:`hf_symmetry.conversion.farr`
run them over checkpoints."""
