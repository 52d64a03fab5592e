"""Three lines in GSM8K's JSONL format (``question``, ``answer`` ending ``#### N``) for tests that
must not need the dataset: two of its training questions and a made-up one whose answer has a
thousands separator (and an ``id``)."""

GSM8K_LINES = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                 "May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
               "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
    {"id": "big", "question": "A shop sold 617 pens on Monday and twice as many on Tuesday. How many pens "
                              "did it sell in total?",
     "answer": "It sold 617*2 = <<617*2=1234>>1,234 pens on Tuesday... total\n#### 1,851"},
]
