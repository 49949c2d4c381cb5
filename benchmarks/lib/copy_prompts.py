"""Prompts whose answers quote them: the workload where speculative decoding by prompt lookup
(n-gram) pays, as edits of code, lists, tables and records do in real use (issue 34)."""
from __future__ import annotations

COPY_PROMPTS = (
    "Here is a Python function. Rename the variable `total` to `acc` and write out the whole "
    "function again:\n\ndef sum_positive(values):\n    total = 0\n    for value in values:\n"
    "        if value > 0:\n            total += value\n    return total\n",
    "Repeat this list exactly, one item per line, but change banana to mango:\n1. apple\n"
    "2. banana\n3. cherry\n4. date\n5. elderberry\n6. fig\n7. grape\n8. honeydew\n9. kiwi\n"
    "10. lemon",
    "Extract the fields name, email, phone and city from this record and write them as JSON:\n"
    "Name: Alice Smith; Email: alice.smith@example.com; Phone: +1 555 0100; City: Paris; "
    "Notes: prefers email, available weekdays.",
    "Convert this CSV to a markdown table:\nname,age,city\nBob,34,Berlin\nCarla,28,Madrid\n"
    "Dmitri,45,Moscow\nEmma,31,London\nFaisal,39,Dubai\nGrace,26,Toronto",
    "Here is a configuration file. Change the port to 8080 and write out the whole file:\n"
    "[server]\nhost = 0.0.0.0\nport = 8000\nworkers = 4\ntimeout = 30\n\n[database]\n"
    "url = postgres://localhost/app\npool_size = 10\necho = false\n",
    "Rewrite this SQL query with every keyword in upper case and nothing else changed:\n"
    "select id, name, email from users where age > 30 and city = 'Paris' order by name "
    "limit 10;",
    "Copy this paragraph and fix its spelling mistakes:\nThe quick brown fox jumpd over the "
    "lazy dog. It was a beautful day, and the sun was shinning over the feilds. The fox ran "
    "accross the river and dissapeared into the forrest.",
    "Here is a JavaScript function. Add a semicolon at the end of every statement and write it "
    "out again:\n\nfunction greet(name) {\n  const message = 'Hello, ' + name\n"
    "  console.log(message)\n  return message\n}\n",
)
