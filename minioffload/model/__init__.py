"""What is trained, and what happens to it between forward and backward: the course's GPT and its text (gpt.py),
activation policies per block (activations.py), and the weights streamed in and out block by block (streaming.py,
streamed_blocks.py).

What this is not: an optimizer; nothing here knows of OffloadAdam.
"""
