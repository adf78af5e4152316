"""Grammar-constrained decoding: which grammar a request asks for (`spec`), checking it
(`check_grammar`, for the API), and compiling and matching it with xgrammar (`backend`)."""
