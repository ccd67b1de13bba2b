// Compiled, not run, by test/types.test.js (tsc --noEmit against the built
// declarations in dist/): the client's methods take and return the generated
// message types. Each @ts-expect-error line must be a type error, or tsc fails.

import { BatchOutcome, blockKeys, indexerClient, serviceClient, type MatchResponse } from '..';
import { XferService } from '../dist/gen/kvmesh/xfer/v1/xfer_pb';

export async function typed(): Promise<void> {
  const client = indexerClient('127.0.0.1:50051');
  const keys: bigint[] = blockKeys('m', '', [1, 2, 3, 4], 2);
  const res: MatchResponse = await client.match({ model: 'm', blockKeys: keys }, { deadlineMs: 100 });
  const depth: number = res.matches[0].depth;
  const worker: string | undefined = res.matches[0].instance?.workerId;
  void depth;
  void worker;

  // @ts-expect-error: block keys are BigInt, not decimal strings
  await client.match({ model: 'm', blockKeys: ['1'] });
  // @ts-expect-error: field names are protobuf-es's (camelCase)
  await client.match({ model: 'm', block_keys: keys });
  // @ts-expect-error: Match has no such method
  await client.matchAll({ model: 'm' });
  // @ts-expect-error: a Match response is not a stats response
  const wrong: { backend: string } = await client.match({ model: 'm' });
  void wrong;

  const call = client.publishEventsStream();
  call.write({ batch: { sequence: 1n, events: [{ kind: { case: 'stored', value: { blockKeys: keys } } }] } });
  // @ts-expect-error: a oneof member is { case, value }
  call.write({ batch: { events: [{ stored: { blockKeys: keys } }] } });
  call.on('data', (r: { ack?: { outcome: BatchOutcome } }) => void r);
  call.end();

  const dump = client.dumpIndex({ model: 'm' });
  for await (const chunk of dump) void chunk;

  const xfer = serviceClient(XferService, '127.0.0.1:50052');
  // @ts-expect-error: the xfer service has no match
  xfer.match({ model: 'm' });
  xfer.close();
  client.close();
}
