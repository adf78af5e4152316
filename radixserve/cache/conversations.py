"""Conversation marks (`PrefixCache.conversations`): where finished requests' prompts ended, so
that a later request whose match runs through such an end is known to continue a conversation
(the scheduler holds such prefixes for a while, `--prefix-hold-s`).

The marks live on the tree's nodes (`TreeNode.ends_prompt`, kept by a split on the lower part).
A cache that keeps nothing remembers nothing (`NoConversations`).
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

from radixserve.cache.tree import PROMPT_END_SLACK, RadixTree, TreeNode


class Conversations(Protocol):
    def mark_prompt_end(self, prompt: Sequence[int], beyond: int, locked: Optional[tuple[TreeNode, int]] = None, *,
                        namespace: Optional[str] = None) -> None:
        """Remember where a finished request's prompt ended (see extends_a_prompt)."""

    def extends_a_prompt(self, node: TreeNode, uncached: Optional[int] = None) -> bool:
        """Whether a match ending at node continues a finished request's prompt (a conversation)."""


class PromptMarks:
    """The tree's conversation marks (RadixCache.conversations)."""

    def __init__(self, tree: RadixTree, page_size: int):
        self.tree = tree
        self.page_size = page_size

    def extends_a_prompt(self, node: TreeNode, uncached: Optional[int] = None) -> bool:
        """Whether the path to node (a request's match, split to end there) runs through the end of
        a finished request's prompt, or stops at most PROMPT_END_SLACK tokens (a page) short of
        one that the request goes past (`uncached`: its prompt tokens after the match; None: it
        does): the request continues that request's conversation. A client sending text
        re-tokenizes the previous prompt's last token together with the reply after it, so the
        next turn's match usually ends a token before the mark; the same prompt sent again (a
        retry, a health probe) ends there too, and continues nothing."""
        root = self.tree.root
        if node is root or node.namespace is not None:  # nothing matched
            return False
        # Such a match split the prompt's last node where it stopped: the marked rest is a child
        # (usually the only one). A node with many children is where prompts branch; not scanned.
        if len(node.children) <= 4:
            slack = max(PROMPT_END_SLACK, self.page_size)
            if uncached is not None:
                slack = min(slack, uncached - 1)
            if any(child.ends_prompt and len(child.key) <= slack for child in node.children.values()):
                return True
        while node is not root:
            if node.ends_prompt:
                return True
            node = node.parent
        return False

    def mark_prompt_end(self, prompt: Sequence[int], beyond: int, locked: Optional[tuple[TreeNode, int]] = None, *,
                        namespace: Optional[str] = None) -> None:
        """Mark the node boundary at the end of a finished request's prompt (whole pages; split
        there if needed), when that end lies beyond `beyond` tokens (what the request found
        cached: a prompt that only repeats a shared prefix marks nothing) and is still cached.
        locked: the node the request held and its path's length; when that is the prompt's end
        (its prompt went into the tree when computed), the node is marked without a walk."""
        end = self.tree.page_floor(len(prompt))
        if end <= beyond:
            return
        if locked is not None and locked[1] == end and locked[0] is not self.tree.root:
            locked[0].ends_prompt = True
            return
        for node, n, pos in self.tree.walk(prompt[:end], namespace):
            if pos + n == end:
                (node if n == len(node.key) else self.tree.split(node, n)).ends_prompt = True


class NoConversations:
    """A cache that keeps no prompt keeps no mark of one."""

    def extends_a_prompt(self, node: TreeNode, uncached: Optional[int] = None) -> bool:
        return False

    def mark_prompt_end(self, prompt: Sequence[int], beyond: int, locked: Optional[tuple[TreeNode, int]] = None, *,
                        namespace: Optional[str] = None) -> None:
        return None
