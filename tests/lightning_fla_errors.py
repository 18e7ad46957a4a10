"""FLA 0.6.0's rel. L2 error (o, the states) against the fp64 oracle on tests/lightning_cases.py (seed 0).

Not measured yet: ``benchmarks/fla_lightning_error_bounds.py`` writes this file on the H200
(``tools/h200_session.sh fla:lightning``). Until then every case keeps the provisional bound
(tests/lightning_cases.py ``bound``). Do not edit by hand."""

LIGHTNING_FLA_ERRORS: dict[str, tuple[float, float]] = {}
