"""Varied chat prompts shared by the engine parity tests."""

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, how are you?' into Spanish.",
    "What does a paged KV cache do in an inference engine?",
    "Give me a short recipe for pancakes.",
    "Who wrote 'Pride and Prejudice'?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What is 17 multiplied by 23?",
    "Name four planets of the solar system.",
    "Write a Python function that reverses a string.",
    "Why do cats purr?",
    "Describe the water cycle briefly.",
    "Suggest a name for a bakery that sells only croissants.",
    "What are the benefits of regular exercise? Answer in a list.",
]

SHARED_SYSTEM = (
    "You are a meticulous assistant for a logistics company. Always answer politely, keep answers "
    "short, mention the relevant department when it helps, never invent tracking numbers, and "
    "remind the customer that our support line is open from 8am to 6pm on weekdays. The company "
    "ships parcels across Europe with next-day delivery in most capitals."
)

SHARED_QUESTIONS = [
    "Where is my parcel?",
    "Can I change my delivery address?",
    "Do you deliver on Sundays?",
    "How do I return a damaged item?",
]


def chat_ids(tokenizer, question: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
