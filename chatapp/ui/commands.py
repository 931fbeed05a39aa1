"""Command-palette entries (ctrl+p) for the chat actions; each runs the same action as its key binding."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

# (title, help, action) — the actions are ChatApp's `action_*` methods.
CHAT_COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("New chat", "Start a fresh conversation", "new_chat"),
    ("Regenerate", "Answer the last message again", "regenerate"),
    ("Edit last message", "Put the last message back in the input to edit and resend", "edit_last"),
    ("Switch program", "Choose the TTFA program that scripts the answers", "switch_program"),
    ("Settings", "Temperature, top-k, top-p, max tokens, seed, routing threshold, constraint", "settings"),
    ("History", "Resume, rename or delete saved conversations", "history"),
    ("Export chat", "Write the conversation as Markdown and JSON to the data directory", "export"),
    ("Copy last answer", "Copy the last answer to the clipboard", "copy_answer"),
    ("Colour tokens by probability", "Toggle: sampled tokens tinted by their probability under the model", "toggle_probabilities"),
    ("Compare with routing off", "Answer the last message again with STT routing off and mark where it diverges", "compare"),
    ("Stop generation", "Stop the answer being generated", "stop"),
    ("Help", "Keys, and where the database and config live", "help"),
)


class ChatCommands(Provider):
    """Chat actions for Textual's command palette."""

    async def discover(self) -> Hits:
        for title, help_text, action in CHAT_COMMANDS:
            yield DiscoveryHit(title, partial(self.app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, action in CHAT_COMMANDS:
            if (score := matcher.match(title)) > 0:
                yield Hit(score, matcher.highlight(title), partial(self.app.run_action, action), help=help_text)
