"""speckv.predictor: the target model, the pinned predictor checkpoint (``store``,
``checkpoint``), its ladder rungs, calibration, entropy and the session that ties them
together (torch; imports the coder, never the reverse). Importing the package imports
nothing else: use its modules."""
