"""Size limits shared by the grader's parts: what is longer than this is no final answer, it is noise or an attack."""

MAX_ANSWER_CHARS = 500  # longest extracted answer we grade (MATH-500's longest is ~60 characters)
