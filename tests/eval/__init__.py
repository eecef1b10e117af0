"""Tests of math500 and HumanEval evaluation."""
