"""Realistic JSON schemas for the structured-outputs sweep: (name, prompt, schema).

Nested objects, arrays with min/max items, enums, bounded numbers, required and optional
properties, $defs/$ref and anyOf. Free-text strings carry a maxLength, as production
extraction schemas usually do (a 135M model sampled at temperature 1 can otherwise write
one string until max_tokens).
"""

from __future__ import annotations


def _s(max_length: int = 40, **kw) -> dict:
    return {"type": "string", "maxLength": max_length, **kw}


ADDRESS = {"type": "object", "properties": {"street": _s(), "city": _s(30), "zip": {"type": "string",
           "pattern": "^[0-9]{5}$"}, "country": {"enum": ["US", "FR", "DE", "JP"]}},
           "required": ["street", "city", "country"], "additionalProperties": False}

SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "Describe a fictional person.", {
        "type": "object", "properties": {"name": _s(), "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("weather", "Give the weather in Paris.", {
        "type": "object", "properties": {
            "city": _s(30), "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
            "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["city", "temperature_c", "conditions"], "additionalProperties": False}),
    ("recipe", "Write a short pancake recipe.", {
        "type": "object", "properties": {
            "title": _s(60), "servings": {"type": "integer", "minimum": 1, "maximum": 12},
            "ingredients": {"type": "array", "minItems": 2, "maxItems": 6, "items": {
                "type": "object", "properties": {"item": _s(30), "grams": {"type": "number", "minimum": 0,
                                                                            "maximum": 1000}},
                "required": ["item", "grams"], "additionalProperties": False}},
            "steps": {"type": "array", "minItems": 1, "maxItems": 4, "items": _s(80)}},
        "required": ["title", "servings", "ingredients", "steps"], "additionalProperties": False}),
    ("address_ref", "Give the address of a museum.", {
        "$defs": {"address": ADDRESS}, "type": "object",
        "properties": {"museum": _s(), "address": {"$ref": "#/$defs/address"}},
        "required": ["museum", "address"], "additionalProperties": False}),
    ("order", "Create an online shop order.", {
        "$defs": {"line": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
            "unit_price": {"type": "number", "minimum": 0.01, "maximum": 999.99}},
            "required": ["sku", "quantity", "unit_price"], "additionalProperties": False}},
        "type": "object", "properties": {
            "order_id": {"type": "integer", "minimum": 1000, "maximum": 9999},
            "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1, "maxItems": 3},
            "status": {"enum": ["pending", "paid", "shipped"]}},
        "required": ["order_id", "lines", "status"], "additionalProperties": False}),
    ("sentiment", "Classify: 'I loved this movie!'", {
        "type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                         "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["label", "confidence"], "additionalProperties": False}),
    ("event", "Describe a conference.", {
        "type": "object", "properties": {
            "name": _s(), "date": {"type": "string", "pattern": "^2[0-9]{3}-[01][0-9]-[0-3][0-9]$"},
            "attendees": {"type": "integer", "minimum": 1, "maximum": 100000},
            "online": {"type": "boolean"}, "tags": {"type": "array", "items": _s(15), "maxItems": 3}},
        "required": ["name", "date", "online"], "additionalProperties": False}),
    ("contact_anyof", "Give one way to contact support.", {
        "type": "object", "properties": {"contact": {"anyOf": [
            {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}},
             "required": ["email"], "additionalProperties": False},
            {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^\\+[0-9]{8,12}$"}},
             "required": ["phone"], "additionalProperties": False}]}},
        "required": ["contact"], "additionalProperties": False}),
    ("matrix", "Give a 2x2 matrix of small integers.", {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9,
                                                                    "maximum": 9}}}),
    ("book", "Describe a classic novel.", {
        "type": "object", "properties": {
            "title": _s(60), "author": {"type": "object", "properties": {"first": _s(20), "last": _s(20)},
                                        "required": ["last"], "additionalProperties": False},
            "year": {"type": "integer", "minimum": 1500, "maximum": 2025},
            "genres": {"type": "array", "items": {"enum": ["fiction", "drama", "romance", "adventure"]},
                       "minItems": 1, "maxItems": 2}},
        "required": ["title", "author", "year"], "additionalProperties": False}),
    ("product", "Describe a laptop for sale.", {
        "type": "object", "properties": {
            "name": _s(), "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 5000},
            "currency": {"enum": ["USD", "EUR"]}, "in_stock": {"type": "boolean"},
            "specs": {"type": "object", "properties": {"ram_gb": {"enum": [8, 16, 32]},
                                                       "cpu": _s(30)},
                      "required": ["ram_gb"], "additionalProperties": False}},
        "required": ["name", "price", "currency", "specs"], "additionalProperties": False}),
    ("todo_list", "Make a todo list for moving house.", {
        "type": "object", "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
            "type": "object", "properties": {"task": _s(50), "done": {"type": "boolean"},
                                             "priority": {"type": "integer", "minimum": 1, "maximum": 3}},
            "required": ["task", "done"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}),
    ("geo_point", "Give the coordinates of Tokyo.", {
        "type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                         "lon": {"type": "number", "minimum": -180, "maximum": 180}},
        "required": ["lat", "lon"], "additionalProperties": False}),
    ("nullable", "Give a user profile; the nickname may be unknown.", {
        "type": "object", "properties": {"username": {"type": "string", "pattern": "^[a-z0-9_]{3,12}$"},
                                         "nickname": {"anyOf": [_s(20), {"type": "null"}]}},
        "required": ["username", "nickname"], "additionalProperties": False}),
    ("tree_ref", "Describe a folder with two files.", {
        "$defs": {"node": {"type": "object", "properties": {
            "name": _s(20), "kind": {"enum": ["file", "folder"]},
            "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/file"}}},
            "required": ["name", "kind"], "additionalProperties": False},
            "file": {"type": "object", "properties": {"name": _s(20), "bytes": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 10**6}},
                     "required": ["name"], "additionalProperties": False}},
        "$ref": "#/$defs/node"}),
    ("invoice", "Write an invoice for consulting work.", {
        "type": "object", "properties": {
            "number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
            "customer": {"type": "object", "properties": {"name": _s(), "vat": {"type": "string",
                                                                               "pattern": "^[A-Z]{2}[0-9]{6}$"}},
                         "required": ["name"], "additionalProperties": False},
            "total": {"type": "number", "minimum": 0, "maximum": 100000},
            "paid": {"type": "boolean"}},
        "required": ["number", "customer", "total", "paid"], "additionalProperties": False}),
    ("rating", "Rate the restaurant 'Chez Paul' from 1 to 5.", {
        "type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                         "comment": _s(80)},
        "required": ["stars"], "additionalProperties": False}),
    ("flight", "Describe a flight from Paris to Tokyo.", {
        "type": "object", "properties": {
            "flight_no": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"},
            "from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "duration_min": {"type": "integer", "minimum": 30, "maximum": 1200},
            "class": {"enum": ["economy", "business", "first"]}},
        "required": ["flight_no", "from", "to", "class"], "additionalProperties": False}),
    ("colors", "List your favourite colors.", {
        "type": "array", "items": {"enum": ["red", "green", "blue", "yellow", "purple"]}, "minItems": 1,
        "maxItems": 3}),
    ("shape_anyof", "Describe a geometric shape.", {
        "anyOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number",
                                                                                       "minimum": 0, "maximum": 100}},
             "required": ["kind", "radius"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "rect"},
                                              "w": {"type": "number", "minimum": 0, "maximum": 100},
                                              "h": {"type": "number", "minimum": 0, "maximum": 100}},
             "required": ["kind", "w", "h"], "additionalProperties": False}]}),
    ("employee", "Describe an employee of a bakery.", {
        "type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": _s(),
            "role": {"enum": ["baker", "cashier", "manager"]},
            "salary": {"type": "number", "minimum": 1000, "maximum": 9000},
            "address": ADDRESS, "skills": {"type": "array", "items": _s(20), "minItems": 1, "maxItems": 3}},
        "required": ["id", "name", "role", "address"], "additionalProperties": False}),
    ("yes_no", "Is the sky blue? Answer with a boolean field.", {
        "type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
        "additionalProperties": False}),
]
