"""Structured-output cases shared by the offline and server tests: ten JSON schemas with prompts
that ask for them, and the regex / choice / grammar cases."""
from __future__ import annotations

import re

# Bounded strings as patterns, not maxLength: xgrammar 0.2's maxLength rule lets raw control
# characters (tabs) into a string, which strict JSON parsers refuse.
WORDS10, WORDS15, WORDS20, WORDS30, WORDS40 = (f"^[A-Za-z0-9 ,.'-]{{1,{n}}}$"
                                             for n in (10, 15, 20, 30, 40))

SCHEMAS: list[tuple[str, dict]] = [
    ("A person with a name and an age, as JSON.",
     {"type": "object", "properties": {"name": {"type": "string", "pattern": WORDS20},
                                       "age": {"type": "integer", "minimum": 0,
                                               "maximum": 120}},
      "required": ["name", "age"], "additionalProperties": False}),
    ("A book with a title, an author and a publication year, as JSON.",
     {"type": "object", "properties": {
         "title": {"type": "string", "pattern": WORDS40},
         "author": {"type": "object", "properties": {
             "first": {"type": "string", "pattern": WORDS15},
             "last": {"type": "string", "pattern": WORDS15}},
             "required": ["first", "last"], "additionalProperties": False},
         "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
      "required": ["title", "author", "year"], "additionalProperties": False}),
    ("Three colours, as a JSON object with a list.",
     {"type": "object", "properties": {
         "colors": {"type": "array", "items": {"type": "string", "pattern": WORDS10},
                    "minItems": 2, "maxItems": 3}},
      "required": ["colors"], "additionalProperties": False}),
    ("Today's weather as JSON.",
     {"type": "object", "properties": {
         "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
         "celsius": {"type": "number", "minimum": -50, "maximum": 50}},
      "required": ["condition", "celsius"], "additionalProperties": False}),
    ("A product with a SKU code like AB-123 and a price, as JSON.",
     {"type": "object", "properties": {
         "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
         "price": {"type": "number", "minimum": 0, "maximum": 1000}},
      "required": ["sku", "price"], "additionalProperties": False}),
    ("A user profile as JSON; the email is optional.",
     {"type": "object", "properties": {
         "username": {"type": "string", "pattern": "^[a-z]{3,12}$"},
         "email": {"type": "string",
                   "pattern": "^[a-z0-9.]{1,15}@[a-z]{1,10}\\.[a-z]{2,3}$"},
         "active": {"type": "boolean"}},
      "required": ["username", "active"], "additionalProperties": False}),
    ("Two points on a plane, as a JSON list of objects.",
     {"type": "array", "items": {
         "type": "object", "properties": {"x": {"type": "integer", "minimum": -10,
                                                "maximum": 10},
                                          "y": {"type": "integer", "minimum": -10,
                                                "maximum": 10}},
         "required": ["x", "y"], "additionalProperties": False},
      "minItems": 1, "maxItems": 2}),
    ("A task with a priority from 1 to 5 and a status, as JSON.",
     {"type": "object", "properties": {
         "task": {"type": "string", "pattern": WORDS30},
         "priority": {"type": "integer", "minimum": 1, "maximum": 5},
         "status": {"type": "string", "enum": ["todo", "doing", "done"]}},
      "required": ["task", "priority", "status"], "additionalProperties": False}),
    ("A city with its country and a list of up to two landmarks, as JSON.",
     {"type": "object", "properties": {
         "city": {"type": "string", "pattern": WORDS20},
         "country": {"type": "string", "pattern": WORDS20},
         "landmarks": {"type": "array", "items": {"type": "string", "pattern": WORDS20},
                       "maxItems": 2}},
      "required": ["city", "country"], "additionalProperties": False}),
    ("A yes/no answer with a confidence between 0 and 1, as JSON: is the sky blue?",
     {"type": "object", "properties": {
         "answer": {"type": "boolean"},
         "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["answer", "confidence"], "additionalProperties": False}),
]

REGEX = r"[0-9]{3}-[0-9]{4}"
REGEX_PROMPT = "Write a phone number like 555-0123:"
CHOICES = ["positive", "negative", "neutral"]
CHOICE_PROMPT = "The sentiment of 'I love this movie!' is"
# Sums of small numbers, e.g. 12+7+3.
GRAMMAR = 'root ::= num ("+" num)*\nnum ::= [1-9] [0-9]?'
GRAMMAR_RE = re.compile(r"[1-9][0-9]?(\+[1-9][0-9]?)*")
GRAMMAR_PROMPT = "Write an addition of three small numbers:"


def chat_prompt(tokenizer, content: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
