"""Requests, scheduling, sampling, acceptance and the engine loop; the drafter interface the engine calls."""
