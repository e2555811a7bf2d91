"""A sampler for inner-loop tests: fixed batches instead of a corpus."""


class Fixed:
    """A sampler that hands out the given batches in turn (and counts them)."""

    def __init__(self, *batches):
        self.batches, self.batches_drawn = list(batches), 0
        self.seq_len, self.batch_sequences = batches[0].shape[1] - 1, batches[0].shape[0]

    def next_batch(self):
        self.batches_drawn += 1
        return self.batches[(self.batches_drawn - 1) % len(self.batches)]
