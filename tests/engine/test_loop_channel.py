"""LoopChannels: calls from another thread run on the loop, in the order they were made."""
import asyncio
import threading

from pagedlm.engine.loop_channel import LoopChannels


def test_calls_from_a_thread_run_on_the_loop_in_order():
    channels = LoopChannels()

    async def main():
        loop = asyncio.get_running_loop()
        channels.register(loop)
        seen, done = [], loop.create_future()
        on_loop = []

        def record(i):
            on_loop.append(threading.current_thread() is threading.main_thread())
            seen.append(i)
            if i == 999:
                done.set_result(None)

        def failing():
            raise RuntimeError("a failing call")

        errors = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx["exception"]))
        thread = threading.Thread(target=lambda: [channels.call(loop, record, i) if i != 500
                                                  else channels.call(loop, failing)
                                                  for i in range(1000)])
        thread.start()
        await asyncio.wait_for(done, 10)
        thread.join()
        return seen, on_loop, errors

    seen, on_loop, errors = asyncio.run(main())
    assert seen == [i for i in range(1000) if i != 500]
    assert all(on_loop)
    assert [str(e) for e in errors] == ["a failing call"]  # reported, and the rest still ran


def test_an_unregistered_or_closed_loop():
    channels = LoopChannels()
    loop = asyncio.new_event_loop()
    ran = []
    channels.call(loop, ran.append, 1)  # not registered: call_soon_threadsafe
    loop.run_until_complete(asyncio.sleep(0))
    assert ran == [1]
    loop.close()
    channels.call(loop, ran.append, 2)  # closed: nobody is listening, nothing raised
    assert ran == [1]
