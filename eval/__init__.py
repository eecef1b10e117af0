"""Evaluations on math500 and HumanEval (accuracy, pass@1, speed), built on the library API."""
