"""Built-in chat templates for ``data.chat_template`` (torch-free: the embedded model's build imports it).

``chatml`` is the ChatML layout Qwen and many others use. ``embedded`` is the embedded tiny model's own
template (shipped as its ``chat_template.jinja``): the same layout with the tokenizer's ``<|bos|>`` /
``<|eos|>`` as the turn markers, because its 3,072 ids fill the embedding matrix and new special tokens
would need rows the committed weights do not have.
"""

from __future__ import annotations

__all__ = ["BUILTIN_TEMPLATES", "CHATML", "EMBEDDED_CHAT_TEMPLATE"]

#: ChatML (Qwen, many others): ``<|im_start|>{role}\n{content}<|im_end|>\n``.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\\n' }}{% endif %}"
)
#: The embedded tiny model's template: ChatML's layout with the tokenizer's own ``<|bos|>`` / ``<|eos|>`` as
#: the turn markers (its 3,072 ids fill the embedding, so new tokens would need rows the weights lack).
EMBEDDED_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|bos|>' + message['role'] + '\\n' + message['content'] + '<|eos|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|bos|>assistant\\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {"chatml": CHATML, "embedded": EMBEDDED_CHAT_TEMPLATE}
