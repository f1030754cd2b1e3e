"""What a slot holds: the header (`slot_format`, its one reader and writer) and the
encoding of a batch into the slot's data region and back (`codec`)."""
