"""A depth-bounded suffix trie with occurrence counts: the structure of suffix decoding.

SuffixDecoding (Oliaro et al. 2024) indexes token sequences in suffix trees whose nodes count
how often their substring occurred, and grows speculation trees from the counts below the
longest match of the context's suffix. Every substring longer than `max_depth` tokens is cut
to its first `max_depth` (a match plus its speculation never needs more), so the trie is a
suffix tree truncated at that depth: each appended token extends at most `max_depth` open
suffixes, and a document of T tokens costs O(T * max_depth) time and nodes.

count(node) = the number of positions where node's substring starts. The occurrences of a
substring that continue with token x are exactly those of substring + x, so the children's
counts split their parent's (the rest end the document there).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

ROOT = 0


class SuffixTrie:
    """Every substring of up to `max_depth` tokens of the documents appended so far."""

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2 (a match and one token), got {max_depth}")
        self.max_depth = max_depth
        self.children: list[dict[int, int]] = [{}]  # node -> {token: child}
        self.counts: list[int] = [0]
        self.depths: list[int] = [0]
        self.tokens = 0  # tokens appended, over all documents
        self._open: list[int] = [ROOT]  # nodes of the suffixes the next token extends

    def __len__(self) -> int:
        return len(self.counts)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append `tokens` to the current document."""
        for token in tokens:
            self.append(int(token))

    def append(self, token: int) -> None:
        """Append one token: every open suffix (and the empty one) gains it."""
        extended = []
        for node in self._open:
            child = self.children[node].get(token)
            if child is None:
                child = self._new_node(node, token)
            self.counts[child] += 1
            if self.depths[child] < self.max_depth:
                extended.append(child)
        self._open = [ROOT, *extended]
        self.tokens += 1

    def end_document(self) -> None:
        """Close the current document: the next tokens start a new one (no match spans both)."""
        self._open = [ROOT]

    def add_document(self, tokens: Sequence[int]) -> None:
        """Index `tokens` as a document of its own."""
        self.end_document()
        self.extend(tokens)
        self.end_document()

    def walk(self, tokens: Sequence[int]) -> int | None:
        """The node spelling `tokens` from the root, or None where no substring does."""
        node = ROOT
        for token in tokens:
            node = self.children[node].get(int(token))
            if node is None:
                return None
        return node

    def match(self, context: Sequence[int], max_match: int) -> tuple[int, int]:
        """(node, length) of the longest suffix of `context`, at most `max_match` tokens (and
        short of max_depth, to leave room for a continuation), that occurred with a token
        after it; (ROOT, 0) when none did. A suffix that continued has shorter suffixes that
        continued too, so the first hit from the longest is the longest."""
        longest = min(max_match, self.max_depth - 1, len(context))
        for length in range(longest, 0, -1):
            node = self.walk(context[len(context) - length:])
            if node is not None and self.children[node]:
                return node, length
        return ROOT, 0

    def continuations(self, node: int) -> list[tuple[int, int, float]]:
        """(token, child, share) for every continuation of `node`'s substring, most frequent
        first (ties: the token seen first); share = the child's count over all continuing
        occurrences, the estimate that the target continues with this token."""
        kids = self.children[node]
        total = sum(self.counts[c] for c in kids.values())
        ranked = sorted(kids.items(), key=lambda item: -self.counts[item[1]])
        return [(token, child, self.counts[child] / total) for token, child in ranked]

    def _new_node(self, parent: int, token: int) -> int:
        self.children[parent][token] = len(self.counts)
        self.children.append({})
        self.counts.append(0)
        self.depths.append(self.depths[parent] + 1)
        return len(self.counts) - 1
