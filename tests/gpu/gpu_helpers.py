"""The demo model and prompts the GPU tests share."""

import os

MODEL = os.environ.get("SPECDEC_GPU_MODEL", "smollm2-135m-instruct")
PROMPTS = [
    "What is 17 * 23? Show your work.", "Write a Python function that reverses a linked list.",
    "Explain what a hash table is in two sentences.", "List the first ten prime numbers.",
    "Solve for x: 3x + 7 = 22.", "Write a haiku about autumn.", "What is the capital of Japan?",
    "Translate 'good morning' into French and Spanish.", "Describe photosynthesis briefly.",
    "Write a SQL query that counts rows in a table named users.", "What is the derivative of x^3 + 2x?",
    "Give three tips for writing clean code.", "How many days are in a leap year?",
    "Write a bash command to count lines in all .py files.", "What does HTTP stand for?",
    "Summarize the plot of Romeo and Juliet in one paragraph.", "Compute the sum of 1 to 100.",
    "Write a JavaScript function that debounces another function.", "What is the boiling point of water in F?",
    "Explain recursion to a child.", "Name four planets of the solar system.",
    "Write a regular expression that matches an email address.", "What is 2 to the power of 10?",
    "Give a short definition of entropy.",
]
