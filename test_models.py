"""The chat edge: message ids appended turn by turn reproduce the template's own rendering."""
import models


def test_turn_and_closing_ids_follow_the_template(tokenizer):
    """Appending ids message by message reproduces the template's rendering of the whole chat."""
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Yes?"}]
    ids = models.encode(tokenizer, models.render(tokenizer, msgs[:1], False))
    ids += models.turn_ids(tokenizer, "Hi there")
    reply = models.encode(tokenizer, "Hello") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids += reply + models.closing_ids(tokenizer, reply) + models.turn_ids(tokenizer, "Yes?")
    assert tokenizer.decode(ids) == models.render(tokenizer, msgs, True)
    cut = models.encode(tokenizer, "Hel")  # a message cut at the token limit gets the end token
    assert tokenizer.decode(cut + models.closing_ids(tokenizer, cut)) == "Hel<|im_end|>\n"


